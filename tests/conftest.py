"""Suite-wide settings: `make test` runs two pytest workers on two cores, so each uses one torch thread
(more threads than cores makes torch's pool thrash and tests slow down by orders of magnitude)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/torch_extensions"))

import torch  # noqa: E402

torch.set_num_threads(1)
