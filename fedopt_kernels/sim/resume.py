"""What a simulation checkpoints after a round, and how a resumed run takes it back.

Everything the next round reads that is not rebuilt identically from the settings:

* the global model, the server rule's state (SCAFFOLD's ``c``, PAdaMFed's ``c`` and ``m``,
  FedDyn's ``h``), the server optimizer's (its ``state_dict``: moments and step count) and the
  position of the client-state store (which entries are current: the
  store writes the entries that changed before the checkpoint names them, ``client_state.py``);
* whether the rule's initial round ran (PAdaMFed's first controls);
* every random generator: client sampling, each client's mini-batch stream that has been made
  (its generator and its place in the current epoch; the others are at their start), the
  augmentation generators of the model and of PAdaMFed-VR's anchor
  copy, and torch's (CPU, CUDA), numpy's and Python's global generators;
* buffers of the model (a user model with BatchNorm keeps running statistics across rounds);
* the per-round metrics so far.

Not saved, because they restart every round or are rebuilt from the seed: the data partition and
the initial model (the settings' fingerprints check them), each client's optimizer (momentum is
cleared at every ``start_round``, FedNLR scales are recomputed from the received model, and the
round index is advanced to the global round, see ``client_round.advance_to_round``), and the
client-batched trainer, whose clients at once and formulations are saved (measured choices may
differ between two processes) and taken back. The tests resume every registered algorithm and compare bitwise with an
uninterrupted run, which is what keeps this list complete.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Optional, Protocol

import torch

from ..fl.checkpoint import global_rng_state, set_global_rng_state
from .data.image_input import ImageClassifier
from .federated_data import FederatedData
from .server_optimizer import build as build_server_step
from .strategy import RoundHost


class ResumableRun(RoundHost, Protocol):
    """What a checkpoint captures and restores of a run: ``Simulation`` is the one (named by shape,
    so that this module need not import it)."""

    data: FederatedData
    history: List[Dict[str, Any]]  # one entry per completed round
    sample_rng: Any  # numpy Generator drawing each round's clients
    batched: Optional[Any]  # the client-batched round, or None
    initial_model_digest: str
    setup_done: bool  # the run's one-time setup (PAdaMFed's initial controls) ran
    checkpoint: Optional[Any]  # its CheckpointDir (the client-state store's copy lives there)
    privacy: Any  # user-level DP's DPFedAvg, or None
    streams: Any  # BatchStreams

    def checkpoint_settings(self) -> Dict[str, Any]: ...


KIND = "fedopt-sim"
# settings that checkpoints saved before their rename hold under the earlier name: compared as the new one
RENAMED_SETTINGS = {"client_parallel": "client_batched", "cuda_graph": "replay"}
# settings that cannot change a run's numbers (a download flag) are not compared on resume
# nor how formulations are chosen: a resumed run takes the checkpoint's choice back (``batched``),
# nor the privacy budget (a run stopped by dp_max_epsilon goes on with a larger one)
_NOT_COMPARED = ("download", "formulations", "formulation_cache", "dp_max_epsilon")


def tensor_digest(tensors: List[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def data_digest(sim: ResumableRun) -> str:
    """A fingerprint of the users' data (train/val/test of existing and new users), in client order."""
    tensors = []
    for c in sim.data.train_clients + sim.data.new_clients:
        tensors += [c.train_x, c.train_y, c.val_x, c.val_y, c.test_x, c.test_y]
    return tensor_digest(tensors)


def run_settings(sim: ResumableRun) -> Dict[str, Any]:
    """The settings a checkpoint must have been saved with to continue ``sim``: its config, and what a
    caller may give besides it (data, model, dtype) as fingerprints, plus the resolved backend,
    device and clients trained at once."""
    out = {k: v for k, v in sim.cfg.to_dict().items() if k not in _NOT_COMPARED}
    out.update(
        {
            "resolved backend": sim.backend,
            # several processes: each on its own GPU, named alike
            "resolved device": str(sim.device) if sim.ranks.world == 1 else sim.device.type,
            "dtype": str(sim.global_params[0].dtype) if sim.global_params else "none",
            "model parameters": [f"{n} {tuple(p.shape)}" for n, p in sim.model.named_parameters()],
            "initial model sha256": sim.initial_model_digest,
            "data sha256": data_digest(sim),
            "clients trained at once": sim.batched.setting() if sim.batched is not None else 1,
        }
    )
    if sim.ranks.world > 1:  # a run's rounds are split by the number of processes
        out["world size"] = sim.ranks.world
    return out


def _augment_generators(module: torch.nn.Module) -> Dict[str, Dict[str, torch.Tensor]]:
    """The states of the augmentation generators (``ImageClassifier.generator_states``) inside ``module``."""
    out = {}
    for name, m in module.named_modules():
        states = m.generator_states() if isinstance(m, ImageClassifier) else None
        if states:
            out[name] = states
    return out


def _set_augment_generators(module: torch.nn.Module, saved: Dict[str, Dict[str, torch.Tensor]]) -> None:
    mods = dict(module.named_modules())
    for name, gens in saved.items():
        m = mods[name]
        for dev, st in gens.items():
            m.generator(torch.device(dev)).set_state(st)


def _cpu(tensors: List[torch.Tensor]) -> List[torch.Tensor]:
    # no copy: torch.save writes the tensors as they are now (a CUDA tensor through a host copy)
    return [t.detach() for t in tensors]


def capture(sim: ResumableRun) -> Dict[str, Any]:
    """The state to checkpoint after ``len(sim.history)`` completed rounds (tensors and plain data)."""
    st = sim.strategy
    models = {"model": sim.model}
    if st.anchor_model is not None:
        models["anchor"] = st.anchor_model
    return {
        "rounds": len(sim.history),
        "history": sim.history,
        "global": _cpu(sim.global_params),
        "server": {k: _cpu(v) for k, v in st.state.items()},
        "server_optimizer": st.server.state_dict(),
        "setup_done": bool(sim.setup_done),
        "sample_rng": sim.sample_rng.bit_generator.state,
        "streams": [
            {"rng": sim.streams[cid].rng.bit_generator.state, "order": list(sim.streams[cid].pending)}
            for cid in sim.streams.made()
        ],
        "stream_ids": sim.streams.made(),
        "generators": {k: _augment_generators(m) for k, m in models.items()},
        "buffers": {k: {n: b.detach() for n, b in m.named_buffers()} for k, m in models.items()},
        "rng": global_rng_state(),
        # the client-batched engine's clients at once and formulations, chosen by measurement
        "batched": None if sim.batched is None else sim.batched.choice_state(),
        # user-level DP: the clip norm and the accountant's position (the noise is named by seed and round)
        "privacy": None if sim.privacy is None else sim.privacy.state_dict(),
    }


def _check_like(what: str, got: List[torch.Tensor], like: List[torch.Tensor]) -> None:
    if len(got) != len(like) or any(g.shape != w.shape or g.dtype != w.dtype for g, w in zip(got, like, strict=True)):
        raise ValueError(f"checkpoint's {what} does not match the model's parameters")


@torch.no_grad()
def restore(sim: ResumableRun, state: Dict[str, Any]) -> None:
    """Put ``state`` (from ``capture`` on a run with the same settings) into ``sim``.

    Everything is checked and converted before the first change to ``sim``: a state that does not
    fit raises ValueError and leaves ``sim`` as it was.
    """
    dev, st = sim.device, sim.strategy
    _check_like("global model", state["global"], sim.global_params)
    server = {k: [t.to(dev) for t in v] for k, v in state["server"].items()}
    if set(server) != set(st.state):
        raise ValueError(f"checkpoint's server state has {sorted(server)}, the rule keeps {sorted(st.state)}")
    for k, v in server.items():
        _check_like(f"server state {k!r}", v, st.state[k])
    kept = {int(cid): [t.to(dev) for t in v] for cid, v in state.get("kept", {}).items()}  # before the store
    for cid in kept:
        if not 0 <= cid < sim.cfg.num_train_clients:
            raise ValueError(f"checkpoint keeps state of client {cid}, which this run does not have")
    ids = [int(i) for i in state["stream_ids"]]
    if ids != sorted(set(ids)) or any(not 0 <= i < len(sim.streams) for i in ids) or len(state["streams"]) != len(ids):
        raise ValueError("checkpoint's batch streams are not this run's clients")
    models = {"model": sim.model, "anchor": st.anchor_model}
    for key, bufs in state["buffers"].items():
        holder = models.get(key)
        mine = dict(holder.named_buffers()) if holder is not None else {}
        if set(bufs) != set(mine):
            raise ValueError(f"checkpoint's buffers of the {key} do not match the model's")
    batched = state.get("batched")
    if isinstance(batched, dict) and "at_once" not in batched and "parallel" in batched:
        batched = {**batched, "at_once": batched["parallel"]}  # its key in checkpoints saved before the rename
    if batched is not None and sim.batched is not None:
        if not isinstance(batched, dict) or not {"at_once", "size"} <= set(batched):
            raise ValueError("checkpoint's client-batched choice is not readable")
    # the server optimizer's state, taken into a twin over the same tensors: the checks of load_state_dict,
    # nothing of the run changed yet (the settings' server_optimizer was compared with the checkpoint's)
    server_step = build_server_step(sim.cfg, sim.global_params, sim.cfg.backend)
    server_step.load_state_dict(state.get("server_optimizer", {}))
    privacy = state.get("privacy")
    if (privacy is None) != (sim.privacy is None):
        raise ValueError("checkpoint's differential-privacy state does not match the run's dp_clip")
    if privacy is not None:
        sim.privacy.check_state(privacy)
    position = state.get("client_state")
    if position is not None and st.rule.keeps and sim.checkpoint is not None:
        # the last check (it raises before anything changes) and the first change
        st.kept.load(sim.checkpoint.folder, sim.checkpoint_settings(), position)
    # from here on nothing raises (but a full disk, writing a checkpoint of before the store)
    for p, v in zip(sim.global_params, state["global"], strict=True):
        p.copy_(v)
    st.state = server
    st.server = server_step
    if position is None:
        st.kept.start()
        for cid, v in sorted(kept.items()):
            st.kept[cid] = v
    sim.setup_done = bool(state["setup_done"])
    sim.sample_rng.bit_generator.state = state["sample_rng"]
    sim.streams.forget()
    for cid, s in zip(ids, state["streams"], strict=True):
        stream = sim.streams[cid]
        stream.rng.bit_generator.state = s["rng"]
        stream.pending = [int(i) for i in s["order"]]
    for key, gens in state["generators"].items():
        holder = models.get(key)
        if holder is not None:
            _set_augment_generators(holder, gens)
    for key, bufs in state["buffers"].items():
        holder = models.get(key)
        if holder is not None:
            for n, b in holder.named_buffers():
                b.copy_(bufs[n])
    set_global_rng_state(state["rng"])
    if batched is not None and sim.batched is not None:
        sim.batched.adopt(batched)
    if privacy is not None:
        sim.privacy.load_state_dict(privacy)
    sim.history = list(state["history"])
    sim.load_global()
