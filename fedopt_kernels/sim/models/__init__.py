"""The simulator's models, all buffer-free (client-batched training runs them under ``torch.func.vmap``).

``small`` (MLPs and CNNs, and ``build_model``: a model from its name), ``text`` (next-character
models for Shakespeare), ``resnet_gn`` (ResNet-18 with GroupNorm).
"""
