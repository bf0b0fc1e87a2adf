"""The parameter table of docs/models.md: each published config in tests/data/hf_configs counted by the harness, by
``transformers`` (its model built on the meta device) and as its publisher states it (tests/data/hf_configs/SOURCES.md).

    .venv/bin/python scripts/model_counts.py > /tmp/counts.md   # needs the dev extra (transformers)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from workloads.config_file import ConfigError  # noqa: E402
from workloads.hf_models import config_model, model_type_of  # noqa: E402

DATA = REPO / "tests" / "data" / "hf_configs"
PUBLISHED = {"llama-3.1-8b": "8.03B", "llama-3.2-1b": "1.23B", "llama-2-7b": "6.74B (Hub)", "mistral-7b-v0.1": "7.24B (Hub)",
             "qwen2.5-7b": "7.61B", "qwen3-8b": "8.2B", "qwen3-0.6b": "0.6B", "olmo-2-1124-7b": "7.30B", "gpt2": "124M",
             "pythia-1.4b": "1,414,647,808", "mpt-7b": "6.7B", "mixtral-8x7b-v0.1": "46.7B / 12.9B",
             "qwen3-30b-a3b": "30.5B / 3.3B", "qwen3-235b-a22b": "235B / 22B", "deepseek-v3": "671B / 37B",
             "kimi-k2": "1T / 32B"}
"""The publishers' figures, total / activated, as SOURCES.md names where each is stated."""


def _transformers(path: Path) -> int:
    content = json.loads(path.read_text())
    config = type(AutoConfig.for_model(model_type_of(content, str(path))[0])).from_dict(content)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def main() -> int:
    print("| config | model_type | harness (published count) | harness active | transformers | publisher |")
    print("|---|---|---|---|---|---|")
    for path in sorted(DATA.glob("*.json")):
        try:
            m = config_model(str(path))
        except ConfigError as e:
            reason = str(e).split(": ", 1)[1].split(" (")[0]  # "unknown model_type 'gpt_oss'"
            print(f"| {path.stem} | refused: {reason} | - | - | - | - |")
            continue
        content = json.loads(path.read_text())
        active = f"{m.params_active_published:,}" if m.moe is not None else "same"
        print(f"| {path.stem} | {model_type_of(content, str(path))[0]} | {m.params_published:,} | {active} | "
              f"{_transformers(path):,} | {PUBLISHED.get(path.stem, '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
