"""Making and finding model folders, apart from serving them: the default model (SmolLM2-135M-Instruct,
from the `gguf`-packaged weights), the llava demo built on it, the seeded tiny test models, and the
check that a folder holds what an engine needs. `epdserve model ...` and the tests use these; no
engine code imports them."""
