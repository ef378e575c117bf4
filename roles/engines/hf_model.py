"""The `hf` / `vllm` engines' shared model settings: the `model:` section, and loading (or building) the model.

A model is a local Hugging Face directory (`model.path`: config, safetensors weights, tokenizer). For
tests and the examples, `model.build` describes a small random-init model instead: the first process
that needs it builds it (weights from `build.seed`, a word-level tokenizer from the words of the
`data:` rows' prompts and answers) and saves it to `model.path` atomically, so trainer and
explorers, started together, all load the same version-0 weights. Nothing is downloaded, ever (`local_files_only`).

Weights travel as `flat_weights(model)`: the model's state dict by its Hugging Face names, tied
weights included under both names (`lm_head.weight` too: vLLM keeps stale logits without it).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from .sections import DataSection, HFBuildSection, HFModelSection

__all__ = [
    "HFModelConfig",
    "ensure_model",
    "load_tokenizer",
    "load_model",
    "flat_weights",
    "parameter_count",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "context_length",
]

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>")


HFModelConfig = HFModelSection  # the `model:` section of the hf engines, as they use it
_BUILD_DEFAULTS = HFBuildSection().model_dump()


# `model.build.chat_template`: every word a token of the word-level vocabulary, the assistant's turn
# ended by <eos> (where generation stops), a tool call in the compact syntax (`tool_calls.compact_calls`):
# few tokens for a small random-init model to learn. `tools` are shown by name only (a schema's words
# would be <unk>).
CHAT_TEMPLATE = (
    "{%- if tools %}<tools> {% for tool in tools %}"
    "{{ tool.function.name if tool.function is defined else tool.name }} {% endfor %}</tools> {% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<assistant> "
    "{%- if message.content %} {{ message.content }}{% endif %}"
    "{%- for call in message.tool_calls or [] %}{% set call = call.function if call.function is defined else call %}"
    " <tool_call> {{ call.name }} "
    "{%- set arguments = call.arguments %}"
    "{%- if arguments is string %} {{ arguments }}"
    "{%- elif arguments | length == 1 %} {{ arguments.values() | first }}"
    "{%- elif arguments %} {{ arguments | tojson }}{% endif %}"
    "{%- endfor %} {{ eos_token }} "
    "{%- else %}<{{ message.role }}> {{ message.content }} {% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<assistant> {% endif %}"
)
TEMPLATE_WORDS = ("<tools>", "</tools>", "<system>", "<user>", "<assistant>", "<tool>", "<tool_call>", "</tool_call>")


def _word_vocab(data: DataSection | None, more: set[str], *, chat_template: bool) -> list[str]:
    """The build's word-level vocabulary: the data rows' words, a stage's files' words (`more`), and
    the chat template's and built-in tools' words when the build has the template."""
    if data is None and not more:
        raise ValueError("model.build makes a word-level tokenizer from the words of the data rows (and of a "
                         "stage's files); give `data:`")
    words: set[str] = set(more)
    if data is not None:
        from .data import load_rows

        for row in load_rows(data):
            words.update(row.prompt.split())
            words.update(row.answer.split())
    if chat_template:
        from .agent.tools import BUILTIN_TOOLS

        words.update((*TEMPLATE_WORDS, *BUILTIN_TOOLS))
    return [*SPECIAL_TOKENS, *sorted(words - set(SPECIAL_TOKENS))]


def _build(config: HFModelConfig, data: DataSection | None, more: set[str], out: Path) -> None:
    """Save a random-init model and its word-level tokenizer under `out`."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spec = config.build.model_dump() if config.build is not None else _BUILD_DEFAULTS
    vocab = _word_vocab(data, more, chat_template=spec["chat_template"])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>", unk_token="<unk>")
    if spec["chat_template"]:
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    ids = dict(vocab_size=len(vocab), tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    if spec["family"] == "gpt2":
        # no dropout: the trainer's logprobs must be those the explorers sampled with
        model_config = transformers.GPT2Config(
            n_embd=spec["hidden_size"], n_inner=spec["intermediate_size"], n_layer=spec["num_layers"],
            n_head=spec["num_heads"], n_positions=spec["max_position_embeddings"],
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **ids)
    else:
        model_config = (transformers.Qwen2Config if spec["family"] == "qwen2" else transformers.LlamaConfig)(
            hidden_size=spec["hidden_size"], intermediate_size=spec["intermediate_size"],
            num_hidden_layers=spec["num_layers"], num_attention_heads=spec["num_heads"],
            num_key_value_heads=spec["num_heads"], head_dim=spec["head_dim"],
            max_position_embeddings=spec["max_position_embeddings"], **ids)
    torch.manual_seed(spec["seed"])
    model = transformers.AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
    model.save_pretrained(out)
    transformers.GenerationConfig(eos_token_id=1, pad_token_id=0, bos_token_id=2).save_pretrained(out)
    (out / _BUILD_MARKER).write_text(json.dumps({"build": spec, "vocab": len(vocab)}, indent=1))


def ensure_model(config: HFModelConfig, *, data: DataSection | None = None, data_path: str | None = None,
                 words: Callable[[], set[str]] | None = None) -> Path:
    """`model.path`, built first when it is missing and `model.build` says how (its vocabulary from
    the rows of `data`, or of the file `data_path` with the default columns, and `words()`: a
    stage's files).

    Built in a temporary directory beside it and renamed into place: concurrent builders (a trainer
    and explorers started at once) each build the same bytes from the seed; the first rename wins.
    """
    path = Path(config.path)
    marker = path / _BUILD_MARKER
    if config.build is not None and marker.is_file():
        built = {**_BUILD_DEFAULTS, **json.loads(marker.read_text())["build"]}  # a field added since: its default
        if built != config.build.model_dump():
            raise ValueError(f"model.path {path} holds a model built with {built}, not model.build "
                             f"{config.build.model_dump(exclude_defaults=True)}; delete {path} "
                             "or point model.path elsewhere")
    if (path / "config.json").is_file() or config.build is None:
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model.path {path}: no Hugging Face model there (config.json missing)")
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        if data is None and data_path is not None:
            data = DataSection(path=data_path)
        _build(config, data, words() if words is not None else set(), tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_BUILD_MARKER = "rolectl-build.json"


def load_tokenizer(path: Path):
    """The model's tokenizer. A built model's word-level tokenizer loads as saved: AutoTokenizer would
    pick the family's class (Qwen2Tokenizer) and swap in that family's pre-tokenizer."""
    import transformers

    if (Path(path) / _BUILD_MARKER).is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_model(config: HFModelConfig, path: Path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=config.torch_dtype)
    return model.to(config.device)


def context_length(hf_config) -> int:
    """The longest sequence a Hugging Face model takes (its positions; GPT-2 calls them `n_positions`)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 1 << 30


def flat_weights(model: torch.nn.Module, *, keep_vars: bool = False) -> dict[str, Tensor]:
    """The model's persistent tensors by Hugging Face name; tied weights appear under each name.

    `keep_vars=True` gives the live parameters (for in-place receives); otherwise detached views.
    """
    return dict(model.state_dict(keep_vars=keep_vars))


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())
