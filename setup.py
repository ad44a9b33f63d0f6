"""pbsd_jax: multi-turn search agents trained with RL and PBSD, in JAX."""

import setuptools

setuptools.setup(
    name="pbsd_jax",
    version="0.1.0",
    description=(
        "JAX/Flax RL for multi-turn search agents with Privileged Bayesian "
        "Self-Distillation (PBSD) turn-level credit."
    ),
    packages=setuptools.find_packages(include=["pbsd_jax", "pbsd_jax.*"]),
    # C++ sources of the CPU kernels, compiled on first use (pbsd_jax.models.attention.cpu_kernels).
    package_data={"pbsd_jax.models.attention": ["kernels/*.cc"]},
    python_requires=">=3.10",
    install_requires=[
        "jax>=0.6",
        "flax>=0.10",
        "optax>=0.2",
        "orbax-checkpoint>=0.11",
        "tensorstore>=0.1.60",
        "seqio>=0.0.19",
        "ml-collections>=1.0",
        "absl-py>=2.0",
        "numpy>=1.26",
        "sentencepiece>=0.2",
        "tokenizers>=0.19",
        "bm25s>=0.2",
        "pyarrow>=14",  # parquet question files (pbsd_jax.data.records)
        "matplotlib>=3.7",  # report plots (pbsd_jax.eval.report)
        "tqdm>=4.60",
        "safetensors>=0.8",  # HF checkpoints (pbsd_jax.models.hf.safetensors_io; bf16 checked on 0.8)
    ],
    extras_require={
        # pytest 9 ignores the node ids pytest-xdist 3.8 tags with their group, so
        # `xdist_group` tests (tests/conftest.py) would be spread over workers.
        "test": ["pytest>=8,<9", "pytest-xdist>=3", "hypothesis>=6",
                 # colabs/ executed in a real kernel (tests/test_colabs.py)
                 "nbclient>=0.10", "nbformat>=5.10", "ipykernel>=6.29",
                 # scripts/aot_compile.py compiled for a TPU topology (tests/test_aot.py)
                 "jax[tpu]",
                 # config.log.wandb, tested in W&B's offline mode (tests/test_wandb.py)
                 "wandb>=0.19",
                 # the dense retriever's index (tests/test_dense_retriever.py; its encoder
                 # needs the `hf` extra too)
                 "faiss-cpu>=1.8"],
        "wandb": ["wandb>=0.19"],
        # libtpu of the installed jax: the TPU compiler, for TPU hosts and for compiling
        # ahead of time on any host (scripts/aot_compile.py).
        "tpu": ["jax[tpu]"],
        # torch is pinned: 2.13.0 is a local CPU wheel on our machines; an open range
        # would pull a multi-GB CUDA build.
        "hf": ["torch==2.13.0", "transformers>=4.51", "jinja2>=3.1.6"],
        # env.retriever=dense, scripts/build_index.py --encoder: a faiss index of sentence
        # embeddings from a transformers encoder.
        "dense": ["faiss-cpu>=1.8", "torch==2.13.0", "transformers>=4.51"],
    },
)
