"""A Flower client whose local training is an FSDP2 job over local processes, with FedNAR (docs/sharded.md)."""
