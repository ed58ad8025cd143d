"""megascale: production LLM pre-training with 3D parallelism, fault recovery and observability."""
from pathlib import Path as _Path

# In a source checkout the sibling folders (driver/, kernels/, data/, ...) are this
# package's subpackages, exactly as setup.py's package_dir installs them.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "setup.py").is_file() and (_checkout / "kernels").is_dir():
    __path__.append(str(_checkout))  # noqa: F821 - __path__ is set for packages

__version__ = "0.1.0"
