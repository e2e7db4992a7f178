# Init container of source "hub": fetches one model repo from the Hugging Face Hub into MODEL_DIR.
# Runs with what the image has (huggingface_hub comes with transformers); $HF_TOKEN, when set, is used
# for gated and private repos. Files already complete in MODEL_DIR (a kept cache volume) are not fetched
# again. Exit status non-zero on any failure, so that the pod does not start without its model.
import os
import sys

from huggingface_hub import snapshot_download

repo, target = os.environ["HF_REPO"], os.environ["MODEL_DIR"]
patterns = [p for p in os.environ.get("HF_ALLOW_PATTERNS", "").split(",") if p] or None
try:
    snapshot_download(repo, revision=os.environ.get("HF_REVISION") or None, local_dir=target,
                      allow_patterns=patterns)
except Exception as exc:  # one line for `kubectl logs`, not a traceback
    sys.exit(f"could not download {repo} into {target}: {type(exc).__name__}: {exc}")
print(f"{repo} is in {target}")
