"""Helpers of the hf / vllm engine tests: the quickstart's tiny random-init model, built once per session
from examples/data (nothing is downloaded), and the engine sections that point at it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "reverse_digits.jsonl"
BUILD = {"family": "qwen2", "hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32,
         "intermediate_size": 128, "seed": 0}


def model_section(path: Path, **overrides: Any) -> dict[str, Any]:
    return {"engine": "hf", "path": str(path), "build": BUILD, "group_size": 4, "max_new_tokens": 5,
            "lr": 3e-3, "minibatches": 2, "micro_batch_size": 16, **overrides}


def data_section(**overrides: Any) -> dict[str, Any]:
    return {"path": str(DATA), "rewards": [{"name": "positional_match"}, {"name": "exact_match", "weight": 0}],
            **overrides}


def built_model(directory: Path) -> Path:
    """The tiny Qwen2 and its word-level tokenizer under `directory/model` (built on first use)."""
    from rolectl.roles.engines.hf_model import HFModelConfig, ensure_model

    section = model_section(directory / "model")
    section.pop("engine")
    return ensure_model(HFModelConfig.model_validate(section), data_path=str(DATA))


# ChatML, as Qwen2's and many other chat models' templates render a conversation (without tools)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHAT_WORDS = ("system", "user", "assistant", "tool", "you", "reverse", "copy", "=", "ok", "no", "sure",
              *(str(d) for d in range(10)))


def chat_model(directory: Path) -> Path:
    """A tiny random-init GPT-2 whose word-level tokenizer has a ChatML chat template (`<|im_start|>`,
    `<|im_end|>` as its end of turn and of sequence), saved under `directory/chat-model` once."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = directory / "chat-model"
    if (path / "config.json").is_file():
        return path
    vocab = ["<pad>", "<|im_end|>", "<|im_start|>", "<unk>", *CHAT_WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>",
                                                     unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_inner=64, n_layer=2, n_head=2, n_positions=64, vocab_size=len(vocab),
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=1,
                                     bos_token_id=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return path
