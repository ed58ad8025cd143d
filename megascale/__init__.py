"""megascale: production LLM pre-training with 3D parallelism, fault recovery and observability.

The top-level folders driver/, executor/, diagnostics/, kernels/ and data/ are this package's
subpackages (megascale.driver, ...) through setup.py's package_dir, in a checkout (`pip install -e .`)
as in a wheel."""

__version__ = "0.1.0"
