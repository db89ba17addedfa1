"""Triton kernels, one file per family, each with its launcher and a torch reference.

This folder ships inside the wheel as `pyserve.kernels`, so the wheel claims no top-level
`kernels` import name (that name belongs to another PyPI project). The repository's top-level
`kernels/` is a symbolic link to it.
"""
