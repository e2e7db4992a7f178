"""What turns a request's text and images into model inputs and tokens back into text: the tokenizer and
chat template, the incremental detokenizer, the image processor and the placeholder expansion of
multimodal prompts. Used by the proxy (no torch needed for text) and by the engines."""
