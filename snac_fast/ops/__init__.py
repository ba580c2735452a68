"""Triton kernels, each module holding its kernel, its plain-torch reference and its torch.library op."""
