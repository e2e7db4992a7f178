"""What turns a request's text and images into model inputs and tokens back into text: the tokenizer and
chat template, the incremental detokenizer, the image processor, the vision checkpoints' configs (how many
tokens an image takes) and the placeholder expansion of multimodal prompts. Used by the proxy (no torch
needed for text) and by the engines; the models import it, never the other way round."""
