import os

# Small CPU tiles, so that small problems cross tile boundaries (online softmax, causal skipping).
os.environ.setdefault("RUDNN_CPU_BLOCK", "16,32")

import pytest  # noqa: E402
import torch  # noqa: E402

import rudnn  # noqa: E402,F401


def _cuda_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA device on this machine"
    if not torch._C._dispatch_has_kernel_for_dispatch_key("rudnn::attention_forward", "CUDA"):
        return "rudnn was built without CUDA kernels"
    return None


_CUDA_SKIP = _cuda_skip_reason()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP)))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True, scope="session")
def _poison_outputs():
    """Fill every uninitialised tensor (the ops' outputs included) with NaN, so that an element a
    kernel fails to write shows up as a NaN the reference does not have."""
    # warn_only: PyTorch's own backends, used as yardsticks on CUDA, have nondeterministic backwards.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(False)
