"""Incremental detokenization on a byte-fallback vocabulary (SentencePiece's, as Gemma's and Llama 2's are)."""
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE

from epdserve.shared.processing.detokenizer import IncrementalDetokenizer


def byte_fallback_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "▁bounce": 1, "▁The": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    tokenizer = Tokenizer(BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    return tokenizer


def test_a_token_that_changes_how_earlier_bytes_decode_does_not_end_the_stream():
    """'✄' in three byte tokens, a stray continuation byte, then a word: decoded together, the four bytes
    become replacement characters, which the streaming decoder refuses ('Invalid prefix'); the request goes
    on, each later token adding its own text."""
    tokenizer = byte_fallback_tokenizer()
    ids = [2, *(3 + b for b in "✄".encode()), 3 + 0x80, 1, 1]
    detok = IncrementalDetokenizer(tokenizer, ["bounce bounce"], include_stop_str_in_output=True,
                                   skip_special_tokens=True)
    stops = [detok.add_token(token_id) for token_id in ids]
    assert detok.text == "The✄ bounce bounce" and stops[-1] == "bounce bounce"


def test_pieces_add_up_to_decoding_at_once():
    tokenizer = byte_fallback_tokenizer()
    ids = [2, *(3 + b for b in "é✄".encode()), 1, 1]
    detok = IncrementalDetokenizer(tokenizer, [], include_stop_str_in_output=False, skip_special_tokens=True)
    for token_id in ids:
        assert detok.add_token(token_id) is None
    assert detok.text == tokenizer.decode(ids) == "Theé✄ bounce bounce"
