"""``--model`` at the door (issue 58's must-show 5): each bad config or factory is one line on stderr naming the file,
the field or the factory and the fix, exit 2, before anything is planned, launched or written."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "hf_configs"
QWEN3 = json.loads((DATA / "qwen3-8b.json").read_text())


def _config(tmp_path: Path, name: str, content) -> str:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def _without(key: str) -> dict:
    return {k: v for k, v in QWEN3.items() if k != key}


CONFIG_CASES = {
    "unknown model_type": ("gpt-oss.json", None, r"gpt-oss-20b\.json: unknown model_type 'gpt_oss' \(architectures "
                                                 r"GptOssForCausalLM\); supported: llama, mistral, qwen2, qwen3, olmo2, "
                                                 r"gpt2, gpt_neox, mpt, mixtral, qwen3_moe, deepseek_v3$"),
    "missing field": ("no-layers.json", _without("num_hidden_layers"),
                      r"no-layers\.json: missing 'num_hidden_layers', which a qwen3 config needs; add it"),
    "wrong type": ("str-layers.json", {**QWEN3, "num_hidden_layers": "36"},
                   r'str-layers\.json: num_hidden_layers = "36" is a string, expected an integer >= 1; fix the file$'),
    "negative": ("neg.json", {**QWEN3, "hidden_size": -4096},
                 r"neg\.json: hidden_size = -4096 is an integer, expected an integer >= 1; fix the file$"),
    "boolean as number": ("bool.json", {**QWEN3, "vocab_size": True},
                          r"bool\.json: vocab_size = true is a boolean, expected an integer >= 1"),
    "malformed JSON": ("broken.json", '{"model_type": "qwen3",', r"broken\.json: not valid JSON \(.* at line 1, "
                                                                  r"column \d+\); fix the file$"),
    "NaN": ("nan.json", '{"model_type": "qwen3", "rms_norm_eps": NaN}', r"nan\.json: not valid JSON \(NaN is not a JSON "
                                                                         r"number; write a finite number\)"),
    "not UTF-8": ("latin1.json", b'{"model_type": "qwen3\xe9"}', r"latin1\.json: not UTF-8 text \(byte \d+\); a "
                                                                  r"config\.json is JSON text$"),
    "not an object": ("list.json", [1, 2], r"list\.json: a config\.json holds one JSON object, this holds a list"),
    "heads do not divide": ("gqa.json", {**QWEN3, "num_key_value_heads": 5},
                            r"gqa\.json: num_attention_heads \(32\) must be a multiple of num_key_value_heads \(5\)"),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_a_bad_config_is_one_line_and_exit_2(case, tmp_path, capsys):
    name, content, message = CONFIG_CASES[case]
    path = str(DATA / "gpt-oss-20b.json") if content is None else _config(tmp_path, name, content)
    out = tmp_path / "out"
    assert main(["plan", "--model", path, "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("harness plan: error: --model "), err
    assert __import__("re").search(message, err), err
    assert not out.exists()


@pytest.mark.parametrize("value,message", [
    ("Qwen/Qwen3-8B", "--model Qwen/Qwen3-8B: no such file or folder here, and nothing is fetched: download its config "
                      "first (hf download Qwen/Qwen3-8B config.json --local-dir Qwen3-8B) and give --model Qwen3-8B"),
    ("no/such/file.json", "--model no/such/file.json: no such file or folder; give a config.json, or a folder holding one"),
])
def test_a_hub_name_or_a_missing_file_is_refused_with_how_to_get_it(value, message, capsys):
    assert main(["plan", "--model", value, "--gpus", "2"]) == 2
    assert capsys.readouterr().err.strip() == f"harness plan: error: {message}"


def test_a_folder_without_config_json_is_refused(tmp_path, capsys):
    assert main(["plan", "--model", str(tmp_path), "--gpus", "2"]) == 2
    assert capsys.readouterr().err.strip() == (f"harness plan: error: --model {tmp_path}: the folder has no config.json; "
                                               f"give the config file, or the checkpoint folder that holds it")


def test_a_checkpoint_folder_is_read_by_its_config_and_named_by_the_folder(tmp_path, capsys):
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3))
    assert main(["plan", "--model", str(folder), "--gpus", "2", "--strategies", "ddp"]) == 0
    assert "Qwen3-8B-fd4b10-cpu2-ddp-fp32-w2-gb8-strong" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--model", str(DATA / "qwen3-8b.json"), "--sizes", "tiny"],
     "--model with --sizes: a --model is the workload, in place of the built-in sizes; give one or the other"),
    (["--model", str(DATA / "qwen3-8b.json"), "--arch", "llama3"],
     "--model with --arch: a --model is the workload, in place of the built-in sizes; give one or the other"),
    (["--full-size"], "--full-size runs a --model as given (not shrunk for CPU ranks); it needs --model"),
    (["--model", ","], "--model is empty; give a config.json, or a folder holding one"),
])
def test_flags_that_do_not_go_with_model_are_refused(argv, message, capsys):
    assert main(["plan", "--gpus", "2", *argv]) == 2
    assert message in capsys.readouterr().err


FACTORIES = textwrap.dedent('''
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.lin(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([Block()])
            self.head = nn.Linear(8, 16)

        def forward(self, idx):
            h = self.emb(idx)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    def raises():
        raise RuntimeError("no weights here")

    def no_block():
        return {"model": Model(), "vocab_size": 16, "seq_len": 8}

    def wrong_block():
        return {"model": Model(), "block": nn.Conv1d, "vocab_size": 16, "seq_len": 8}

    def not_a_class():
        return {"model": Model(), "block": "Block", "vocab_size": 16, "seq_len": 8}

    def bad_seq():
        return {"model": Model(), "block": Block, "vocab_size": 16, "seq_len": 0}

    def good():
        return {"model": Model(), "block": Block, "vocab_size": 16, "seq_len": 8}
''')


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    yield "my_factories"
    sys.modules.pop("my_factories", None)


@pytest.mark.parametrize("func,message", [
    ("raises", "the factory raised RuntimeError: no weights here; fix the factory"),
    ("no_block", "the factory returned no block; return a dict (or an object) with model, block (the repeated block's "
                 "class), vocab_size and seq_len"),
    ("wrong_block", "the model holds no Conv1d; block must be the class of its repeated blocks"),
    ("not_a_class", "block is 'Block', not an nn.Module class; return the class of the model's repeated block"),
    ("bad_seq", "seq_len = 0, expected an integer >= 1"),
    ("missing", "my_factories has no function 'missing'; name a function that returns the model"),
])
def test_a_bad_factory_is_one_line_and_exit_2(func, message, factories, capsys):
    assert main(["plan", "--model", f"{factories}:{func}", "--gpus", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--model {factories}:{func}: {message}" in err, err


def test_a_module_that_does_not_import_is_refused(capsys):
    assert main(["plan", "--model", "no_such_package.models:make", "--gpus", "2"]) == 2
    assert "--model no_such_package.models:make: cannot import 'no_such_package.models'" in capsys.readouterr().err


def test_a_good_factory_plans_data_parallel_cells_and_refuses_what_it_cannot_split(factories, capsys):
    assert main(["plan", "--model", f"{factories}:good", "--gpus", "2", "--strategies", "ddp,fsdp,tp,pp"]) == 0
    out = capsys.readouterr().out
    assert "good-" in out and "344 parameters" in out  # embedding 16 x 8, block 8 x 8 + 8, head 8 x 16 + 16
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| good-")}
    assert "valid" in rows[next(k for k in rows if "-ddp-" in k)]
    assert "its factory returned no tp_plan" in rows[next(k for k in rows if "-tp-" in k)]
    assert "a pipeline, context and expert parallel split the harness's own layers" in \
        rows[next(k for k in rows if "-pp-" in k)]
