"""The client-parallel engine (``--client-parallel N``, docs/client_batched.md): N clients' local steps at once.

``trainer`` (stacked clients and a batched optimizer), ``loss`` (vmapped per-client gradients),
``batches`` (padded per-client batches), ``step_graph`` (the step replayed from a CUDA graph),
``size`` (``--client-parallel auto``). ``sim.parallel_round`` runs a round on it.
"""
