"""The C extension ckptd._pages (the store's per-page data path, docs/adr/0012); everything
else is in pyproject.toml. Needs libzstd-dev, liblz4-dev and libxxhash-dev (scripts/setup.sh installs
them). If it cannot be built, the install goes on without it and the store runs its slower
pure-Python data path (and says so once in its log)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "ckptd._pages",
            sources=["ckptd/_pages.c"],
            libraries=["zstd", "lz4"],
            extra_compile_args=["-O3", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
