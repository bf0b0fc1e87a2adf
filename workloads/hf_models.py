"""A Hugging Face ``config.json`` mapped onto the harness's own layers (:mod:`workloads.architecture`).

Supported ``model_type`` values (or, where the type is another name, the ``architectures`` entry: Kimi K2's
``kimi_k2`` is a ``DeepseekV3ForCausalLM``):

* dense: ``llama`` (Llama 2, 3, 3.1 with ``rope_scaling``), ``mistral``, ``qwen2`` (q/k/v biases), ``qwen3`` (q/k
  norms per head), ``olmo2`` (norms after each sub-layer, q/k norms over the projection), ``gpt2``, ``gpt_neox``
  (parallel residual, partial rotary), ``mpt`` (ALiBi, no biases, ``expansion_ratio``);
* MoE: ``mixtral``, ``qwen3_moe``, ``deepseek_v3`` (multi-head latent attention, shared experts, the first
  ``first_k_dense_replace`` blocks dense, group-limited sigmoid routing with ``routed_scaling_factor``).

Every field is read with its type checked. A field that changes compute or memory is modelled, or named in a
refusal (a layout the harness cannot build: :class:`~workloads.config_file.ConfigError`) or in a note (what the
harness trains differently: an untied LM head, no dropout, no multi-token-prediction module). A field the mapping
does not know is named in a note too; only :data:`HARMLESS` ones (metadata, token ids, inference settings) pass
without a word. No modelling code is taken from anywhere: each mapping reads the published meaning of the fields.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import Any

from workloads.architecture import CONFIG_ARCH, ModelSize
from workloads.config_file import ConfigError, Fields, canonical, config_path, digest, model_name, read_json
from workloads.model_parts import MLASpec, ModelOrigin, MoESpec
from workloads.shrink import VERSION as SHRINK_VERSION
from workloads.shrink import shrink

DEFAULT_SEQ_LEN = 4096
"""A config model's sequence when ``--seq-len`` is not given (at most its ``max_position_embeddings``): Megatron-Bridge's
and most published pre-training rows' length."""
HARMLESS = frozenset({
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "_name_or_path", "bos_token_id",
    "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "initializer_factor", "output_router_logits",
    "auto_map", "is_decoder", "tokenizer_class", "task_specific_params", "id2label", "label2id", "output_attentions",
    "output_hidden_states", "return_dict", "problem_type", "chunk_size_feed_forward", "is_encoder_decoder",
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels", "summary_first_dropout",
    "scale_attn_weights", "reorder_and_upcast_attn", "scale_attn_by_inverse_layer_idx", "n_ctx", "classifier_dropout",
    "init_device", "use_sliding_window", "max_window_layers", "use_mrope", "rope_interleave", "ep_size",
    "router_jitter_noise", "attn_implementation", "_attn_implementation", "prefix",
    "decoder_start_token_id", "sep_token_id", "init_config", "tokenizer_name", "torchscript", "tie_encoder_decoder", "prune_heads",
    "bos_token", "eos_token", "use_return_dict", "verbose",
})
"""Fields that change nothing the harness builds or measures (names, token ids, inference-only switches). Fields a
mapping reads are not listed: reading them marks them."""
DROPOUTS = ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "emb_pdrop",
            "attention_probs_dropout_prob", "hidden_dropout_prob")


def _dropout_notes(f: Fields) -> list[str]:
    """Dropout: the harness trains without it (its step is a mask and a multiply per element)."""
    out = []
    for key in DROPOUTS:
        if key in f.content:
            rate = f.number(key, 0.0, positive=False)
            if rate:
                out.append(f"{key} {rate:g}: not modelled, the harness trains without dropout")
    attn = f.content.get("attn_config")
    if isinstance(attn, dict) and attn.get("attn_pdrop"):
        out.append(f"attn_config.attn_pdrop {attn['attn_pdrop']}: not modelled, the harness trains without dropout")
    return out


def _rope(f: Fields) -> tuple[float, dict, list[str]]:
    """RoPE's theta (``rope_theta``, or transformers 5's ``rope_parameters``) and scaling, which changes the angles
    only: not what a step computes or holds."""
    params = f.obj("rope_parameters")
    theta = f.number("rope_theta", float(params.get("rope_theta") or 10_000.0))
    scaling = f.obj("rope_scaling") if f.has("rope_scaling") else {}
    kind = scaling.get("rope_type") or scaling.get("type") or params.get("rope_type")
    notes = [f"rope_scaling {kind}: changes RoPE's angles (and YaRN's softmax scale) only, not a step's compute or "
             f"memory"] if kind and kind != "default" else []
    return theta, params, notes


def _tied(f: Fields, default: bool) -> tuple[bool, list[str]]:
    tied = f.flag("tie_word_embeddings", default)
    return tied, (["tie_word_embeddings: the harness trains an untied LM head (tensor and pipeline parallel place it "
                   "freely): one vocab x d matrix more than the published count, which records keep as "
                   "params_published"] if tied else [])


def _act(f: Fields, key: str, family: tuple[str, ...], default: str) -> list[str]:
    act = f.text(key, default)
    if act not in family:
        return [f"{key} {act}: the harness's MLP uses {family[0]} (the same matmuls; one elementwise op differs)"]
    return []


def _window(f: Fields, always: bool) -> tuple[int | None, list[str]]:
    """A sliding window the harness does not build: cells whose sequence is longer are refused
    (:func:`workloads.architecture.seq_len_error`); shorter ones attend exactly as a full causal window does."""
    layer_types = f.items("layer_types")  # transformers 5 writes each layer's attention kind
    on = always or f.flag("use_sliding_window", False) or any(t != "full_attention" for t in layer_types)
    window = f.integer("sliding_window", None) if "sliding_window" in f.content else None
    return (window if on else None), []


def _dense_attention(f: Fields, *, head_dim_key: bool = True) -> dict[str, Any]:
    d = f.integer("hidden_size")
    heads = f.integer("num_attention_heads")
    kv = f.integer("num_key_value_heads", heads)
    if heads % kv:
        raise ConfigError(f"{f.where}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv})")
    head_dim = f.integer("head_dim", None) if head_dim_key else None
    if head_dim is None and d % heads:
        raise ConfigError(f"{f.where}: hidden_size ({d}) is not a multiple of num_attention_heads ({heads}) and "
                          f"there is no head_dim; add head_dim")
    return dict(d_model=d, n_heads=heads, n_kv_heads=kv,
                attn_head_dim=head_dim if head_dim and head_dim != d // heads else None)


def _llama_like(f: Fields, notes: list[str], *, qkv_bias: bool = False, window_always: bool = False) -> dict[str, Any]:
    """The llama block's fields (llama, mistral, qwen2, qwen3, olmo2, mixtral, qwen3_moe share them)."""
    out = _dense_attention(f)
    theta, _, rope_notes = _rope(f)
    tied, tie_notes = _tied(f, False)
    window, _ = _window(f, window_always)
    attention_bias = f.flag("attention_bias", False)
    mlp_bias = f.flag("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConfigError(f"{f.where}: attention_bias {str(attention_bias).lower()} with mlp_bias "
                          f"{str(mlp_bias).lower()}: the harness builds biases on every linear or on none (or on q, "
                          f"k, v only, as qwen2); set both alike")
    if f.integer("pretraining_tp", 1) != 1:
        notes.append("pretraining_tp: a checkpoint-slicing detail of Llama 2's conversion; the model is the same")
    notes += rope_notes + tie_notes + _act(f, "hidden_act", ("silu", "swish"), "silu")
    out.update(n_layers=f.integer("num_hidden_layers"), vocab_size=f.integer("vocab_size"), rope_theta=theta,
               norm_eps=f.number("rms_norm_eps", 1e-6), tied_published=tied, norm="rmsnorm", norm_bias=False,
               mlp="swiglu", bias=attention_bias, qkv_bias=qkv_bias and not attention_bias, positions="rope",
               max_positions=f.integer("max_position_embeddings", None), sliding_window=window)
    return out


def _dense(f: Fields, notes: list[str], **kw: Any) -> dict[str, Any]:
    out = _llama_like(f, notes, **kw)
    out["ffn_width"] = f.integer("intermediate_size")
    return out


def _llama(f: Fields, notes: list[str]) -> dict[str, Any]:
    return _dense(f, notes)


def _mistral(f: Fields, notes: list[str]) -> dict[str, Any]:
    return _dense(f, notes, window_always=True)


def _qwen2(f: Fields, notes: list[str]) -> dict[str, Any]:
    return _dense(f, notes, qkv_bias=True)


def _qwen3(f: Fields, notes: list[str]) -> dict[str, Any]:
    return {**_dense(f, notes), "qk_norm": "head"}


def _olmo2(f: Fields, notes: list[str]) -> dict[str, Any]:
    return {**_dense(f, notes), "qk_norm": "proj", "norm_after": True}


def _gpt2(f: Fields, notes: list[str]) -> dict[str, Any]:
    d, heads = f.integer("n_embd"), f.integer("n_head")
    if d % heads:
        raise ConfigError(f"{f.where}: n_embd ({d}) must be a multiple of n_head ({heads})")
    if f.flag("add_cross_attention", False):
        raise ConfigError(f"{f.where}: add_cross_attention true: an encoder-decoder's cross-attention is not supported")
    tied, tie_notes = _tied(f, True)
    notes += tie_notes + _act(f, "activation_function", ("gelu_new", "gelu", "gelu_pytorch_tanh"), "gelu_new")
    return dict(d_model=d, n_heads=heads, n_layers=f.integer("n_layer"), vocab_size=f.integer("vocab_size"),
                ffn_width=f.integer("n_inner", None), norm_eps=f.number("layer_norm_epsilon", 1e-5), tied_published=tied,
                max_positions=f.integer("n_positions"))


def _gpt_neox(f: Fields, notes: list[str]) -> dict[str, Any]:
    out = _dense_attention(f, head_dim_key=False)
    theta, params, rope_notes = _rope(f)
    theta = f.number("rotary_emb_base", theta)
    fraction = f.number("rotary_pct", float(params.get("partial_rotary_factor", 0.25)))
    if not 0 < fraction <= 1:
        raise ConfigError(f"{f.where}: rotary_pct = {fraction} must be in (0, 1]")
    if not f.flag("attention_bias", True):
        raise ConfigError(f"{f.where}: attention_bias false: the harness's gpt_neox block has biases on every linear "
                          f"(as GPT-NeoX and Pythia); not supported")
    tied, tie_notes = _tied(f, False)
    notes += rope_notes + tie_notes + _act(f, "hidden_act", ("gelu",), "gelu")
    out.update(n_layers=f.integer("num_hidden_layers"), vocab_size=f.integer("vocab_size"), rope_theta=theta,
               norm_eps=f.number("layer_norm_eps", 1e-5), tied_published=tied, positions="rope",
               rotary_fraction=fraction, parallel_residual=f.flag("use_parallel_residual", True),
               ffn_width=f.integer("intermediate_size"), max_positions=f.integer("max_position_embeddings", None))
    return out


def _mpt(f: Fields, notes: list[str]) -> dict[str, Any]:
    attn = f.sub("attn_config")
    if not attn.flag("alibi", False):
        raise ConfigError(f"{f.where}: attn_config.alibi false: an MPT with a learned position table is not supported "
                          f"(transformers builds ALiBi only); set alibi true")
    if attn.flag("qk_ln", False):
        raise ConfigError(f"{f.where}: attn_config.qk_ln true: MPT's q/k LayerNorm is not supported")
    if attn.number("alibi_bias_max", 8.0) != 8.0:
        raise ConfigError(f"{f.where}: attn_config.alibi_bias_max must be 8 (the slopes the harness builds)")
    if attn.has("clip_qkv"):
        notes.append("attn_config.clip_qkv: not modelled (an elementwise clamp of q, k and v)")
    if attn.has("softmax_scale"):
        notes.append("attn_config.softmax_scale: not modelled (the scale multiplies the scores only)")
    if f.number("embedding_fraction", 1.0) != 1.0:
        notes.append("embedding_fraction: not modelled (it scales the embedding's gradient only)")
    if f.flag("learned_pos_emb", False):
        notes.append("learned_pos_emb: MPT with ALiBi builds no position table (as transformers); none is built")
    if f.has("logit_scale"):
        notes.append("logit_scale: not modelled (one multiply of the logits)")
    no_bias = f.flag("no_bias", True)
    f.text("norm_type", "low_precision_layernorm")
    tied, tie_notes = _tied(f, True)
    notes += tie_notes
    d = f.integer("d_model")
    heads = f.integer("n_heads")
    if d % heads:
        raise ConfigError(f"{f.where}: d_model ({d}) must be a multiple of n_heads ({heads})")
    return dict(d_model=d, n_heads=heads, n_layers=f.integer("n_layers"), vocab_size=f.integer("vocab_size"),
                ffn_width=int(f.number("expansion_ratio", 4.0) * d), norm_eps=f.number("layer_norm_epsilon", 1e-5),
                tied_published=tied, bias=not no_bias, norm_bias=not no_bias, positions="alibi",
                max_positions=f.integer("max_seq_len", None))


def _moe_balancing(f: Fields, notes: list[str]) -> dict[str, Any]:
    """DeepSeek-V3's per-expert bias, whatever the config's auxiliary loss: a Switch loss is computed over each
    micro-batch a rank routes, so its gradient, and the routing after it, depends on the layout; the bias moves from
    the load over every rank, and every layout matches one device. Both cost the same: a few elementwise ops."""
    coef = f.number("router_aux_loss_coef", 0.0, positive=False)
    if coef:
        notes.append(f"router_aux_loss_coef {coef:g}: the experts are balanced by DeepSeek-V3's per-expert bias "
                     f"instead (the same compute; an auxiliary loss per micro-batch would make each layout's step "
                     f"differ from one device's)")
    return dict(balancing="bias")


def _mixtral(f: Fields, notes: list[str]) -> dict[str, Any]:
    out = _llama_like(f, notes, window_always=True)
    e = f.integer("num_local_experts")
    moe = MoESpec(e, f.integer("num_experts_per_tok"), f.integer("intermediate_size"), **_moe_balancing(f, notes))
    return {**out, "moe": moe}


def _qwen3_moe(f: Fields, notes: list[str]) -> dict[str, Any]:
    out = {**_llama_like(f, notes), "qk_norm": "head"}
    if f.integer("decoder_sparse_step", 1) != 1 or f.items("mlp_only_layers"):
        raise ConfigError(f"{f.where}: decoder_sparse_step other than 1 or a non-empty mlp_only_layers (dense "
                          f"blocks among the MoE ones) is not supported; every published Qwen3-MoE has neither")
    e = f.integer("num_experts", None) or f.integer("num_local_experts")
    moe = MoESpec(e, f.integer("num_experts_per_tok"), f.integer("moe_intermediate_size"),
                  norm_topk=f.flag("norm_topk_prob", False), **_moe_balancing(f, notes))
    f.integer("intermediate_size", None)  # the dense width of mlp_only_layers, none here
    return {**out, "moe": moe}


def _deepseek_v3(f: Fields, notes: list[str]) -> dict[str, Any]:
    d, heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    f.integer("num_key_value_heads", heads)  # MLA: every head has its own k and v from the latent
    f.integer("pretraining_tp", 1)
    f.integer("head_dim", None)  # transformers 5 writes the rotary part's width here, and qk_head_dim: both derived
    theta, _, rope_notes = _rope(f)
    tied, tie_notes = _tied(f, False)
    if f.flag("attention_bias", False):
        raise ConfigError(f"{f.where}: attention_bias true: DeepSeek-V3's attention has no biases; not supported")
    if f.integer("moe_layer_freq", 1) != 1:
        raise ConfigError(f"{f.where}: moe_layer_freq other than 1 (MoE blocks interleaved with dense ones after the "
                          f"first_k_dense_replace) is not supported")
    score = f.text("scoring_func", "sigmoid")
    if score not in ("sigmoid", "softmax"):
        raise ConfigError(f"{f.where}: scoring_func {score!r}: choose sigmoid or softmax")
    method = f.text("topk_method", "noaux_tc")
    mtp = f.integer("num_nextn_predict_layers", 0, minimum=0)
    if mtp:
        notes.append(f"num_nextn_predict_layers {mtp}: the multi-token-prediction module is not built (nor by "
                     f"transformers): the counts are the main model's")
    for key in ("aux_loss_alpha", "seq_aux"):
        if key in f.content:
            f.read.add(key)
            notes.append(f"{key}: DeepSeek-V3's sequence-wise balance loss is not modelled; its experts are balanced by "
                         f"the per-expert bias (topk_method {method})")
    mla = MLASpec(q_rank=f.integer("q_lora_rank", 0, minimum=0), kv_rank=f.integer("kv_lora_rank"),
                  nope_dim=f.integer("qk_nope_head_dim"), rope_dim=f.integer("qk_rope_head_dim"), v_dim=f.integer("v_head_dim"))
    if f.integer("qk_head_dim", mla.qk_dim) != mla.qk_dim:
        raise ConfigError(f"{f.where}: qk_head_dim ({f.content['qk_head_dim']}) must equal qk_nope_head_dim + "
                          f"qk_rope_head_dim ({mla.qk_dim}); fix the file")
    moe = MoESpec(f.integer("n_routed_experts"), f.integer("num_experts_per_tok"), f.integer("moe_intermediate_size"),
                  n_shared=f.integer("n_shared_experts", 0, minimum=0), balancing="bias", score=score,
                  norm_topk=f.flag("norm_topk_prob", True), n_group=f.integer("n_group", 1),
                  topk_group=f.integer("topk_group", 1), routed_scale=f.number("routed_scaling_factor", 1.0))
    notes += rope_notes + tie_notes + _act(f, "hidden_act", ("silu",), "silu")
    n_layers = f.integer("num_hidden_layers")
    return dict(d_model=d, n_heads=heads, n_layers=n_layers, vocab_size=f.integer("vocab_size"), rope_theta=theta,
                norm_eps=f.number("rms_norm_eps", 1e-6), tied_published=tied, norm="rmsnorm", norm_bias=False,
                mlp="swiglu", bias=False, positions="rope", mla=mla, moe=moe,
                dense_layers=min(n_layers, f.integer("first_k_dense_replace", 0, minimum=0)),
                dense_d_ff=f.integer("intermediate_size"), max_positions=f.integer("max_position_embeddings", None))


MAPPINGS: dict[str, Callable[[Fields, list[str]], dict[str, Any]]] = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "olmo2": _olmo2, "gpt2": _gpt2,
    "gpt_neox": _gpt_neox, "mpt": _mpt, "mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}
SUPPORTED = tuple(MAPPINGS)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                 "Qwen3ForCausalLM": "qwen3", "Olmo2ForCausalLM": "olmo2", "GPT2LMHeadModel": "gpt2",
                 "GPTNeoXForCausalLM": "gpt_neox", "MptForCausalLM": "mpt", "MixtralForCausalLM": "mixtral",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
"""A config's ``architectures`` entry, for a ``model_type`` the harness does not know by name."""


def model_type_of(content: dict[str, Any], where: str) -> tuple[str, list[str]]:
    """The supported type a config is read as, and a note where it is read by its ``architectures``."""
    declared = content.get("model_type")
    if declared in MAPPINGS:
        return declared, []
    listed = content.get("architectures")
    archs: list = listed if isinstance(listed, list) else []
    for name in archs:
        if isinstance(name, str) and name in ARCHITECTURES:
            return ARCHITECTURES[name], [f"model_type {declared!r} read as {ARCHITECTURES[name]} (architectures "
                                         f"{name})"]
    if declared is None:
        raise ConfigError(f"{where}: no model_type (nor a known architectures entry); add model_type, one of "
                          f"{', '.join(SUPPORTED)}")
    raise ConfigError(f"{where}: unknown model_type {declared!r}"
                      + (f" (architectures {', '.join(map(str, archs))})" if archs else "")
                      + f"; supported: {', '.join(SUPPORTED)}")


def map_config(content: dict[str, Any], where: str) -> tuple[dict[str, Any], list[str]]:
    """ModelSize fields of a config, and the notes on what the harness builds differently or leaves out."""
    model_type, notes = model_type_of(content, where)
    f = Fields(content, where, model_type)
    fields = MAPPINGS[model_type](f, notes)
    notes += _dropout_notes(f)
    if "quantization_config" in content:
        f.read.add("quantization_config")
        notes.append("quantization_config: the checkpoint's storage format; the harness trains in --precision")
    unknown = [k for k in f.unread() if k not in HARMLESS and k not in DROPOUTS]
    if unknown:
        notes.append(f"not read: {', '.join(unknown)} (unknown to the {model_type} mapping; each may change compute "
                     f"or memory the harness does not model)")
    return fields, notes


@lru_cache(maxsize=64)
def _size_of(content_json: str, name: str, where: str, shrunk: bool) -> ModelSize:
    content = json.loads(content_json)
    fields, notes = map_config(content, where)
    fields.setdefault("max_positions", None)
    seq = min([DEFAULT_SEQ_LEN, *(v for v in (fields["max_positions"], fields.get("sliding_window")) if v)])
    label = f"{name}-{digest(content)[:6]}"
    origin = ModelOrigin(kind="config", name=name, digest=digest(content), content=content_json, notes=tuple(notes))
    try:
        size = ModelSize(label, seq_len=seq, device_kind="gpu", arch=CONFIG_ARCH, origin=origin, **fields)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if fields["max_positions"] is not None and not size.learned_positions:
        size = replace(size, max_positions=None)  # RoPE and ALiBi hold no table: the length only bounds the default
    if shrunk:
        size = shrink(size)
    return size


def config_model(value: str, shrunk: bool = False) -> ModelSize:
    """The model a ``--model`` value names (a ``config.json`` or a folder holding one), at full size or shrunk by
    :mod:`workloads.shrink`'s rules. ConfigError (one line) for anything that cannot be read or mapped."""
    path = config_path(value)
    content = read_json(path)
    return _size_of(canonical(content), model_name(path), f"--model {path}", shrunk)


def model_from_origin(origin: dict[str, Any]) -> ModelSize:
    """A record's model rebuilt from what it kept (``config.model``): no file needed."""
    if origin.get("kind") != "config" or not isinstance(origin.get("content"), dict):
        raise ConfigError(f"a record's model {origin.get('name')!r} of kind {origin.get('kind')!r} cannot be rebuilt "
                          f"from the record (a module's code is not in it); run it again with --model")
    if origin.get("shrink") not in (None, SHRINK_VERSION):
        raise ConfigError(f"a record's model {origin.get('name')!r} was shrunk by rules {origin['shrink']}, and this "
                          f"harness shrinks by {SHRINK_VERSION}: its workload cannot be rebuilt as it ran; run it again")
    return _size_of(canonical(origin["content"]), str(origin.get("name") or "model"), f"record model "
                    f"{origin.get('name')}", bool(origin.get("shrink")))
