"""Rebuild tests/gpu/tokenizer/: a tiny byte-level BPE tokenizer for the GPU tests.

The device check builds its random-weight models around this tokenizer, so it needs
neither the GGUF package nor the network. Run from the repository root:
``python tests/gpu/make_tokenizer.py`` (tokenizers is a dependency of transformers).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 384
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the tiny models' bos and eos


def corpus(root: Path) -> list[str]:
    """Lines of the project's own README: English prose and code words."""
    text = (root / "README.md").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()]


def build(root: Path, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(root), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    build(here.parent.parent, here / "tokenizer")
