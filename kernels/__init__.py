"""Attention and fused-op kernels with pure-PyTorch fallbacks; installed as `megascale.kernels`."""
import sys


def _installed_kernels_spec():
    """The spec of a `kernels` found on sys.path outside this repository, if one is installed."""
    import importlib.machinery
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    return importlib.machinery.PathFinder.find_spec("kernels", elsewhere)


# Imported by its folder's name, this package shadows Hugging Face's `kernels` (a dependency of transformers)
# whenever the repository root is on sys.path (`python -m ...` run from it), and transformers then fails to
# import. Under that name, hand the import over to the installed package when there is one.
_installed = _installed_kernels_spec() if __name__ == "kernels" else None
if _installed is not None:
    import importlib.util

    _module = importlib.util.module_from_spec(_installed)
    sys.modules[__name__] = _module  # the import system returns what sys.modules holds once this file has run
    _installed.loader.exec_module(_module)
else:
    from .attention import DocumentMask, attention, attention_backend
    from .norm import LayerNorm, RMSNorm, fused_backend, gelu

    __all__ = ["DocumentMask", "LayerNorm", "RMSNorm", "attention", "attention_backend", "fused_backend", "gelu"]
