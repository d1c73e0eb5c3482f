"""The simulator's models, all buffer-free (client-batched training runs them on ``sim.batched``'s engines).

``build`` (a model from its name: ``MODELS``, ``build_model``), ``small`` (MLPs and CNNs), ``text``
(next-character models for Shakespeare), ``resnet_gn`` (ResNet-18 with GroupNorm).
"""
