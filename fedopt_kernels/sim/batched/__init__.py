"""The client-batched engine (``--client-batched N``, docs/client_batched.md): N clients' local steps at once.

``trainer`` (stacked clients and a batched optimizer), ``loss`` (the gradient engines: the layers
engine, ``layers_engine``, the model's own code over all clients' samples with client layers from
``layers``, else vmap), ``batches`` (padded per-client batches), ``trainer_replay`` (the step
replayed from a CUDA graph, ``--replay``), ``size`` (``--client-batched auto``).
``sim.batched_round`` runs a round on it.
"""
