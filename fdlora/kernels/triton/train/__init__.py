"""Triton kernels of the trainable layers' backward."""
