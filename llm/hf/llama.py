"""Hugging Face Llama checkpoints and :class:`~llm.model.GPT`: names, configs, slices.

:class:`~llm.model.GPT` computes what transformers' ``LlamaForCausalLM`` computes, and the
weights keep their layout: both store a Linear as ``[out, in]``, and the q/k weights of HF's
Llama are in the "rotate half" RoPE layout (pairs ``(i, i + Dh/2)``, angles
``pos * theta ** (-2i / Dh)``) that :func:`llm.model.apply_rope` uses, so a tensor moves with
only its name changed. (Meta's original ``consolidated.*.pth`` files pair neighbours instead
and are not read here.) ``python -m llm.convert`` (:mod:`llm.convert`) converts whole
checkpoints; :class:`HFCheckpoint` reads any rank's slice of one tensor straight from a HF
directory (``safe_open(...).get_slice``), for initialising a parallel model from it.

Names, ours <-> HF (i: layer; shapes legend below)::

    tok_emb.weight                   model.embed_tokens.weight                  [V, D]
    blocks.i.attn_norm.weight        model.layers.i.input_layernorm.weight      [D]
    blocks.i.attn.{q,o}_proj.weight  model.layers.i.self_attn.{q,o}_proj.weight [D, D]
    blocks.i.attn.{k,v}_proj.weight  model.layers.i.self_attn.{k,v}_proj.weight [Hkv*Dh, D]
    blocks.i.mlp_norm.weight         model.layers.i.post_attention_layernorm.weight  [D]
    blocks.i.mlp.{gate,up}_proj.weight  model.layers.i.mlp.{gate,up}_proj.weight [F, D]
    blocks.i.mlp.down_proj.weight    model.layers.i.mlp.down_proj.weight        [D, F]
    norm.weight                      model.norm.weight                          [D]
    lm_head.weight                   lm_head.weight      [V, D]; absent when tied

Config, ``GPTConfig`` field <- ``config.json`` key: vocab_size <- vocab_size, num_layers <-
num_hidden_layers, num_heads <- num_attention_heads, num_kv_heads <- num_key_value_heads,
d_model <- hidden_size, d_ff <- intermediate_size, max_seq_len <- max_position_embeddings,
rope_theta <- rope_theta (or rope_parameters.rope_theta, transformers >= 5), tie_embeddings <-
tie_word_embeddings, norm_eps <- rms_norm_eps. What GPT cannot compute (RoPE scaling, biases,
another head_dim or activation, dropout, another architecture) is refused by name and value.

Shapes legend:
    V: vocabulary, D: hidden_size (d_model), F: intermediate_size (d_ff), Dh: head_dim,
    Hkv: key/value heads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.consolidate import read_header, torch_dtype
from common.grid import ceil_div
from common.sharded import Slab
from llm.model import GPTConfig

ARCHITECTURE = "LlamaForCausalLM"
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = ("config.json", "model.safetensors",
                                          "model.safetensors.index.json")
# ours <-> HF, per layer; the rest map one to one
_LAYER = {"attn_norm.weight": "input_layernorm.weight",
          "mlp_norm.weight": "post_attention_layernorm.weight",
          **{f"attn.{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
          **{f"mlp.{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
_GLOBAL = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "lm_head.weight": "lm_head.weight"}
_FROM_HF_LAYER = {v: k for k, v in _LAYER.items()}
_FROM_HF_GLOBAL = {v: k for k, v in _GLOBAL.items()}
# buffers some older HF files hold that are recomputed from the config, never weights
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def to_hf_name(name: str) -> str:
    """The HF Llama name of our parameter ``name`` (``blocks.3.attn.q_proj.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``); ValueError for a name GPT does not have."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"{name!r} is not a parameter of llm.model.GPT")


def from_hf_name(name: str) -> str:
    """Our parameter name of the HF Llama tensor ``name`` (inverse of :func:`to_hf_name`);
    ValueError for a tensor GPT has no place for (a bias, another architecture's)."""
    if name in _FROM_HF_GLOBAL:
        return _FROM_HF_GLOBAL[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if m and m.group(2) in _FROM_HF_LAYER:
        return f"blocks.{m.group(1)}.{_FROM_HF_LAYER[m.group(2)]}"
    raise ValueError(f"tensor {name!r} has no counterpart in llm.model.GPT (a Llama without "
                     "biases)")


def param_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Our stored parameters and their shapes, in GPT's state_dict order; a tied LM head is
    stored once, as ``tok_emb.weight`` (as our checkpoints and HF's ``save_pretrained`` do)."""
    d, f, v = config.d_model, config.d_ff, config.vocab_size
    kv = int(config.num_kv_heads or config.num_heads) * config.head_dim  # resolved: an int
    shapes: dict[str, tuple[int, ...]] = {"tok_emb.weight": (v, d)}
    for i in range(config.num_layers):
        b = f"blocks.{i}"
        shapes |= {f"{b}.attn_norm.weight": (d,), f"{b}.attn.q_proj.weight": (d, d),
                   f"{b}.attn.k_proj.weight": (kv, d), f"{b}.attn.v_proj.weight": (kv, d),
                   f"{b}.attn.o_proj.weight": (d, d), f"{b}.mlp_norm.weight": (d,),
                   f"{b}.mlp.gate_proj.weight": (f, d), f"{b}.mlp.up_proj.weight": (f, d),
                   f"{b}.mlp.down_proj.weight": (d, f)}
    shapes["norm.weight"] = (d,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (v, d)
    return shapes


# ------------------------------------------------------------------------------- configs


def _refuse(where: object, field: str, value: Any, why: str) -> ValueError:
    return ValueError(f"{where}: {field} = {json.dumps(value)}: {why}; llm.model.GPT cannot "
                      "represent this model, so it is not converted")


def _rope_theta(hf: dict[str, Any], where: object) -> float:
    """rope_theta from a transformers 4 (top level, rope_scaling) or 5 (rope_parameters)
    config, refusing any scaling."""
    theta = hf.get("rope_theta", 10000.0)
    for field in ("rope_scaling", "rope_parameters"):
        rope = hf.get(field)
        if rope is None:
            continue
        kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) \
            else rope
        extra = set(rope) - {"rope_type", "type", "rope_theta"} if isinstance(rope, dict) \
            else set()
        if kind != "default" or extra:
            raise _refuse(where, field, rope, "GPT has plain RoPE only (no scaling, no "
                          "partial rotary)")
        theta = rope.get("rope_theta", theta)
    return float(theta)


def config_from_hf(hf: dict[str, Any], where: object = CONFIG_FILE) -> GPTConfig:
    """The :class:`GPTConfig` of a HF ``LlamaForCausalLM`` ``config.json`` (a dict).

    Raises:
        ValueError: naming the field and value GPT cannot represent (another architecture or
            model_type, rope_scaling, attention/MLP biases, another head_dim or hidden_act,
            dropout), or a missing size.
    """
    archs = hf.get("architectures")
    if hf.get("model_type", "llama") != "llama":
        raise _refuse(where, "model_type", hf["model_type"], "only Llama is supported")
    if archs is not None and archs != [ARCHITECTURE]:
        raise _refuse(where, "architectures", archs, f"only [{ARCHITECTURE!r}] is supported")
    if archs is None and "model_type" not in hf:
        raise ValueError(f"{where}: neither model_type nor architectures says this is a Llama")
    checks = {"hidden_act": ("silu", "GPT's MLP is SwiGLU (silu)"),
              "attention_bias": (False, "GPT's attention Linears have no bias"),
              "mlp_bias": (False, "GPT's MLP Linears have no bias"),
              "attention_dropout": (0.0, "GPT has no dropout"),
              "partial_rotary_factor": (1.0, "GPT rotates every dimension of a head")}
    for field, (want, why) in checks.items():
        if field in hf and hf[field] != want:
            raise _refuse(where, field, hf[field], why)
    for field in ("vocab_size", "num_hidden_layers", "num_attention_heads", "hidden_size",
                  "intermediate_size"):
        if not isinstance(hf.get(field), int):
            raise ValueError(f"{where}: {field} is missing or not an integer "
                             f"({json.dumps(hf.get(field))})")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") is not None and hf["head_dim"] * heads != d:
        raise _refuse(where, "head_dim", hf["head_dim"], f"GPT's head_dim is hidden_size / "
                      f"num_attention_heads = {d} / {heads}")
    theta = _rope_theta(hf, where)
    try:
        return GPTConfig(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"],
                         num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                         d_model=d, d_ff=hf["intermediate_size"],
                         max_seq_len=hf.get("max_position_embeddings", 2048), rope_theta=theta,
                         tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                         norm_eps=float(hf.get("rms_norm_eps", 1e-6)))
    except ValueError as e:  # the sizes themselves do not fit (GPTConfig says which)
        raise ValueError(f"{where}: {e}") from e


def config_to_hf(config: GPTConfig, dtype: torch.dtype = torch.float32,
                 token_ids: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``config.json`` of a HF ``LlamaForCausalLM`` computing what ``GPT(config)`` does
    (readable by transformers 4 and 5: rope_theta at the top level and in rope_parameters).

    Args:
        dtype: the dtype the weights are written in (``torch_dtype``).
        token_ids: bos/eos/pad token ids (default none: our byte-level models have no
            special tokens).
    """
    ids = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    ids |= {k: v for k, v in (token_ids or {}).items() if k in ids}
    return {"architectures": [ARCHITECTURE], "model_type": "llama",
            "vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads,
            "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
            "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
            "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": 0.02, "use_cache": True,
            "torch_dtype": str(dtype).removeprefix("torch."), **ids}


# ------------------------------------------------------------------------------- reading


class HFCheckpoint:
    """A HF Llama directory opened for reading: config, names, shapes, any slice of a tensor.

    Reads ``config.json`` and the safetensors headers (``model.safetensors``, or the shards
    that ``model.safetensors.index.json`` lists) and checks that the tensors are exactly
    GPT's with GPT's shapes; tensor data is read on demand through ``safe_open``'s
    ``get_slice`` (memory-mapped, one file at a time: only the asked rows and columns are
    copied).

    Attributes:
        path: the directory.
        hf_config: its config.json.
        config: the :class:`GPTConfig` (:func:`config_from_hf`).

    Raises:
        ValueError: a config GPT cannot represent, missing/unknown tensors, wrong shapes,
            non-float weights.
        FileNotFoundError: no config.json or no safetensors weights.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        config_file = self.path / CONFIG_FILE
        if not config_file.is_file():
            raise FileNotFoundError(f"{self.path} has no {CONFIG_FILE} (not a Hugging Face "
                                    "model directory)")
        self.hf_config: dict[str, Any] = json.loads(config_file.read_text())
        self.config = config_from_hf(self.hf_config, config_file)
        self._file_of = self._weight_files()
        self._info: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for fname in sorted(set(self._file_of.values())):
            header, _ = read_header(self.path / fname)
            for hf_name, entry in header.items():
                if self._file_of.get(hf_name) != fname:
                    continue
                try:
                    self._info[hf_name] = (torch_dtype(entry["dtype"]), tuple(entry["shape"]))
                except ValueError as e:
                    raise ValueError(f"{self.path / fname}: {hf_name}: {e}") from None
        self._check_tensors()
        self._open: tuple[str, Any] | None = None  # (file name, its safe_open handle)

    def _weight_files(self) -> dict[str, str]:
        """HF tensor name -> file name."""
        index, single = self.path / INDEX_FILE, self.path / WEIGHTS_FILE
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        if single.is_file():
            header, _ = read_header(single)
            return dict.fromkeys(header, WEIGHTS_FILE)
        raise FileNotFoundError(f"{self.path} has neither {WEIGHTS_FILE} nor {INDEX_FILE} "
                                "(only safetensors weights are read, not pytorch_model.bin)")

    def _check_tensors(self) -> None:
        want = param_shapes(self.config)
        have: dict[str, tuple[int, ...]] = {}
        for hf_name, (dtype, shape) in self._info.items():
            if _DERIVED.fullmatch(hf_name):
                continue
            try:
                name = from_hf_name(hf_name)
            except ValueError as e:
                raise ValueError(f"{self.path}: {e}") from None
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue  # tied: transformers ignores a stored copy too
            if dtype not in _FLOATS:
                raise ValueError(f"{self.path}: {hf_name} is {dtype}, not a float")
            have[name] = shape
        missing = [to_hf_name(n) for n in want if n not in have]
        listed = [n for n in self._file_of if n not in self._info]
        if missing or listed:
            raise ValueError(f"{self.path}: tensors missing: {(missing + listed)[:4]}"
                             f"{' ...' if len(missing + listed) > 4 else ''}")
        wrong = [f"{to_hf_name(n)} {have[n]} (expected {want[n]})" for n in want
                 if have[n] != want[n]]
        if wrong:
            raise ValueError(f"{self.path}: shapes differ from the config's: "
                             f"{'; '.join(wrong[:3])}")

    def names(self) -> list[str]:
        """Our names of the stored parameters (:func:`param_shapes` order)."""
        return list(param_shapes(self.config))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._info[self._hf(name)][1]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype the tensor is stored in."""
        return self._info[self._hf(name)][0]

    def _hf(self, name: str) -> str:
        if name == "lm_head.weight" and self.config.tie_embeddings:
            name = "tok_emb.weight"
        return to_hf_name(name)

    def read_block(self, name: str, rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
        """Rows ``rows[0]:rows[1]``, columns ``cols[0]:cols[1]`` of tensor ``name`` (ours), in
        its stored dtype; a 1-D tensor is one row (``rows=(0, 1)``), returned 1-D.

        Shapes:
            returns: [rows[1] - rows[0], cols[1] - cols[0]] (1-D tensor: [cols[1] - cols[0]])
        """
        hf_name = self._hf(name)
        fname = self._file_of[hf_name]
        if self._open is None or self._open[0] != fname:  # one file mapped at a time
            from safetensors import safe_open

            self._open = None  # unmap the previous file before mapping the next
            self._open = (fname, safe_open(str(self.path / fname), framework="pt"))
        part = self._open[1].get_slice(hf_name)
        if len(self.shape(name)) == 1:
            if tuple(rows) != (0, 1):
                raise ValueError(f"{name} is 1-D: rows must be (0, 1), got {rows}")
            return part[cols[0]:cols[1]]
        return part[rows[0]:rows[1], cols[0]:cols[1]]

    def read(self, name: str, slab: Slab, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The local tensor of ``slab`` of tensor ``name`` (ours), as
        :meth:`common.sharded.ShardedCheckpoint.read` returns it (padding rows and columns
        zero, ``slab.flat`` honoured), converted to ``dtype``; reads only the rows it needs.

        Shapes:
            returns: the local shape of ``slab`` (:mod:`common.sharded`)
        """
        shape = self.shape(name)
        if tuple(slab.shape) != shape:
            raise ValueError(f"{self.path}: {name} has shape {shape}, the slab {slab.shape}")
        num_rows, num_cols = (1, shape[0]) if len(shape) == 1 else shape
        ids, width = slab.row_ids(), slab.width
        lo_row, hi_row = 0, ids.size  # block rows the local tensor covers
        if slab.flat is not None:
            lo_row = min(slab.flat[0] // max(width, 1), ids.size)
            hi_row = min(ceil_div(slab.flat[1], max(width, 1)), ids.size)
        ids = ids[lo_row:hi_row]
        region = torch.zeros(ids.size, width, dtype=dtype)  # [block rows, width]
        real = np.flatnonzero(ids < num_rows)
        c_lo, c_hi = slab.cols[0], min(slab.cols[1], num_cols)
        if real.size and c_hi > c_lo:
            first, last = int(ids[real].min()), int(ids[real].max()) + 1
            block = self.read_block(name, (first, last), (c_lo, c_hi)).to(dtype)
            block = block.reshape(last - first, c_hi - c_lo)
            region[torch.from_numpy(real), : c_hi - c_lo] = block[torch.from_numpy(ids[real]
                                                                                 - first)]
        if slab.flat is None:
            return region if len(shape) == 2 else region.reshape(-1)
        out = torch.zeros(slab.flat[1] - slab.flat[0], dtype=dtype)
        start = slab.flat[0] - lo_row * width
        got = region.reshape(-1)[start:start + out.numel()]
        out[: got.numel()] = got
        return out

    def close(self) -> None:
        """Unmap the open weights file (reading again reopens it)."""
        self._open = None

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_slice(hf_dir: str | os.PathLike, name: str, rows: tuple[int, int] | None = None,
               cols: tuple[int, int] | None = None, dtype: torch.dtype = torch.float32
               ) -> torch.Tensor:
    """Rows and columns of our tensor ``name`` straight from a HF Llama directory, as
    ``dtype`` (None: all); for one rank's slice of a model initialised from HF weights
    (:meth:`HFCheckpoint.read` takes a :class:`~common.sharded.Slab`, padding and depth
    split included; open the directory once with :class:`HFCheckpoint` to read many).

    Shapes:
        returns: [rows, cols] (1-D tensor: [cols])
    """
    with HFCheckpoint(hf_dir) as ck:
        shape = ck.shape(name)
        num_rows, num_cols = (1, shape[0]) if len(shape) == 1 else shape
        return ck.read_block(name, rows or (0, num_rows), cols or (0, num_cols)).to(dtype)
