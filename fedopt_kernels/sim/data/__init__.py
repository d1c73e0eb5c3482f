"""The simulator's data: data sets, their file readers, partitions, and each client's batches.

``datasets`` (digits, Synthetic; ``ArrayDataset``), the readers of ``--data-dir`` (``folder``: its
checks; ``idx``: MNIST, Fashion-MNIST; ``cifar``; ``leaf_json``: LEAF's layout, read by ``femnist``
and ``shakespeare``; ``build_shakespeare`` writes that layout from the plays), ``partition``
(Dirichlet, shards, classes, splits), ``clients`` (a client's tensors and its batch stream) and the
image input stage (``image_input``, with its train-time ``augment``). Nothing here reads the
simulation's settings: ``sim.federated_data`` turns a ``SimConfig`` into users.
"""
