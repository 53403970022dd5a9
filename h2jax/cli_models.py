"""``h2jax convert`` and ``h2jax tokenize``: real models and real data in and out.

- ``h2jax convert SRC OUT``: SRC a Hugging Face LLaMA directory (config.json +
  *.safetensors) -> OUT an h2jax checkpoint directory at step 0 (``h2jax train ...
  --init-from OUT``), with OUT/model.yaml holding the experiment's ``model:`` section; or SRC
  an h2jax checkpoint directory -> OUT a Hugging Face directory (config.json +
  model.safetensors). Unconvertible input exits 2 with one line naming the tensor or key.
  OUT must be new or empty: ``--overwrite`` moves a folder that holds files aside
  (``OUT.<time>``, with a line), never into the new one.
- ``h2jax tokenize FILES... --tokenizer tokenizer.json --out tokens.bin``: text or jsonl
  files -> the flat token file ``data.token_file`` reads (nanoGPT layout).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from h2jax._errors import fail, say
from h2jax._paths import claim_folder
from h2jax._strict import ConfigError


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Register ``convert``, ``tokenize`` and ``data`` on the ``h2jax`` parser."""
    c = subparsers.add_parser(
        "convert",
        help="Hugging Face LLaMA directory <-> h2jax checkpoint directory (direction from what SRC holds)",
    )
    c.add_argument("src", help="a Hugging Face model directory (config.json + *.safetensors) or an h2jax checkpoint")
    c.add_argument("out", help="directory to write: the h2jax checkpoint, or the Hugging Face directory")
    c.add_argument("--seq-len", type=int, default=None, help="import: model.seq_len (default: the context, <= 4096)")
    c.add_argument("--step", type=int, default=None, help="export: the checkpoint step (default: the latest)")
    c.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="import: model.dtype (compute); export: the dtype of the written tensors (float32 is exact)",
    )
    c.add_argument(
        "--overwrite",
        action="store_true",
        help="OUT may hold files: the old folder is moved aside (OUT.<time>) with a line, never deleted",
    )
    c.set_defaults(func=cmd_convert)

    t = subparsers.add_parser(
        "tokenize",
        help="text / jsonl / parquet files -> a flat token file (data.token_file) or a token store (data.sources)",
    )
    t.add_argument(
        "inputs",
        nargs="+",
        help="text (.txt, ...), JSON-lines (.jsonl) or Parquet (.parquet) files, or folders of them, in this order",
    )
    t.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json, or 'byte' (256 ids)")
    t.add_argument(
        "--out",
        required=True,
        help="tokens: the file to write (raw little-endian ids, no header); arrayrecord: a new folder",
    )
    t.add_argument(
        "--format",
        default="tokens",
        choices=("tokens", "arrayrecord"),
        help="tokens: one flat file (data.token_file); arrayrecord: ArrayRecord shards of one record per "
        "document and a manifest (data.sources)",
    )
    t.add_argument("--shards", type=int, default=1, help="arrayrecord: the number of shard files")
    t.add_argument(
        "--field", default="text", help="jsonl / parquet: the field (column) holding the text (default: text)"
    )
    t.add_argument(
        "--split",
        default="paragraph",
        choices=("paragraph", "line", "file"),
        help="text files: what one document is (blank-line separated paragraphs, lines, or the whole file)",
    )
    t.add_argument("--dtype", default="auto", choices=("auto", "uint16", "uint32"), help="token dtype (auto: fits)")
    t.add_argument(
        "--eos",
        default="auto",
        help="token appended after every document: a token string, 'auto' (the tokenizer's end-of-text "
        "token if it has one) or 'none'",
    )
    t.add_argument("--bos", default="none", help="token put before every document (a token string or 'none')")
    t.add_argument("--batch-mb", type=float, default=8.0, help="text per parallel batch, MB")
    t.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    t.set_defaults(func=cmd_tokenize)

    d = subparsers.add_parser("data", help="look at token stores: `h2jax data inspect PATH ...`")
    dsub = d.add_subparsers(dest="data_command", required=True)
    i = dsub.add_parser("inspect", help="what token stores hold, and a few of their documents decoded")
    i.add_argument("paths", nargs="+", help="token stores: arrayrecord folders, Megatron prefixes, flat token files")
    i.add_argument(
        "--tokenizer", default=None, help="decode with this ('byte' or a tokenizer.json; default: the store's)"
    )
    i.add_argument("--samples", type=int, default=2, help="documents to show from each store (default 2)")
    i.add_argument("--chars", type=int, default=200, help="characters of each sample shown (default 200)")
    i.add_argument("--token-dtype", default="uint16", choices=("uint16", "uint32"), help="flat files: the id dtype")
    i.set_defaults(func=cmd_data_inspect)


def cmd_convert(args: argparse.Namespace) -> int:
    from h2jax.convert import ConvertError, export_hf, import_hf

    src = Path(args.src)
    try:
        if (src / "config.json").is_file() or (src / "commits").is_dir():
            if Path(args.out).resolve() == src.resolve():
                raise ConfigError("OUT", f"{args.out} is SRC itself; expected a new folder")
            kept = claim_folder(args.out, key="OUT", overwrite=args.overwrite)
            if kept is not None:
                say(None, f"{args.out} held files: they are kept in {kept}", style="bold yellow", prog="h2jax convert")
        if (src / "config.json").is_file():
            cfg = import_hf(src, args.out, seq_len=args.seq_len, dtype=args.dtype)
            print(
                f"converted {src} -> {args.out} step 0: {cfg.n_layers} layers, d_model {cfg.d_model}, "
                f"{cfg.n_heads}/{cfg.kv_heads} heads, vocab {cfg.vocab_size}, {cfg.num_params() / 1e6:.2f} M parameters"
            )
            print(
                f"model section: {Path(args.out) / 'model.yaml'}; train with: h2jax train EXP.yaml --init-from {args.out}"
            )
        elif (src / "commits").is_dir():
            cfg, files = export_hf(src, args.out, step=args.step, dtype=args.dtype)
            print(f"exported {src} -> {args.out} ({', '.join(files)}; weights in {args.dtype})")
            if "tokenizer.json" not in files:
                say(
                    None,
                    f"no tokenizer found beside {src} or the run's data.tokenizer: {args.out} loads as a "
                    "model; copy the tokenizer files in for AutoTokenizer",
                    style="bold yellow",
                    prog="h2jax convert",
                )
        else:
            raise ConvertError(
                f"{src}: neither a Hugging Face model directory (config.json) nor an h2jax checkpoint (commits/)"
            )
    except ConfigError as e:
        return fail("convert", str(e))
    except ConvertError as e:
        return fail("convert error", str(e))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from h2jax.data import tokenize_files

    try:
        stats = tokenize_files(
            args.inputs,
            args.out,
            tokenizer=args.tokenizer,
            field=args.field,
            split=args.split,
            dtype=args.dtype,
            eos=args.eos,
            bos=args.bos,
            batch_bytes=int(args.batch_mb * 1e6),
            progress=not args.no_progress,
            format=args.format,
            shards=args.shards,
        )
    except (ConfigError, ValueError, OSError) as e:
        return fail("tokenize error", str(e))
    if args.format == "arrayrecord":
        print(
            f"wrote {stats.tokens:,} tokens ({stats.dtype}) of {stats.documents:,} documents in {args.shards} "
            f"shard(s) to {args.out} in {stats.seconds:.1f} s "
            f"({stats.tokens / max(stats.seconds, 1e-9):,.0f} tokens/s); train with "
            f"'data.sources={{{args.out}: 1.0}}' data.tokenizer={args.tokenizer}"
        )
        return 0
    print(
        f"wrote {stats.tokens:,} tokens ({stats.dtype}) of {stats.documents:,} documents to {args.out} "
        f"in {stats.seconds:.1f} s ({stats.tokens / max(stats.seconds, 1e-9):,.0f} tokens/s); "
        f"train with data.token_file={args.out} data.token_dtype={stats.dtype} data.tokenizer={args.tokenizer}"
    )
    return 0


def cmd_data_inspect(args: argparse.Namespace) -> int:
    from h2jax.data import load_tokenizer, open_store

    for path in args.paths:
        try:
            st = open_store(path, key=path, token_dtype=args.token_dtype)
            spec = args.tokenizer or (st.tokenizer_path if st.tokenizer_path else None)
            tok = load_tokenizer(spec) if spec else None
        except ConfigError as e:
            return fail("data error", str(e))
        docs = "-" if st.num_documents is None else f"{st.num_documents:,}"
        print(f"{path}: {st.kind}, {docs} documents, {st.num_tokens:,} tokens ({st.dtype.name})")
        if st.num_documents:
            lengths = np.diff(st.offsets)
            print(
                f"  document length: mean {lengths.mean():,.1f}, median {np.median(lengths):,.0f}, "
                f"min {lengths.min():,}, max {lengths.max():,} tokens"
            )
        ident = f", {st.tokenizer}" if st.tokenizer else ""
        vocab = f"vocabulary {st.vocab_size:,}" if st.vocab_size else "vocabulary not recorded"
        print(f"  tokenizer: {st.tokenizer_path or 'not recorded'} ({vocab}{ident}); end-of-document id: {st.eod_id}")
        if tok is None:
            print("  (no tokenizer to decode with: --tokenizer)")
            continue
        count = min(args.samples, st.num_documents or 1)
        for k in range(count):
            ids = st.document(k) if st.num_documents else st.read(0, min(st.num_tokens, 4 * args.chars))[0]
            text = tok.decode(np.asarray(ids).tolist())
            more = "..." if len(text) > args.chars else ""
            print(f"  [{k}] {len(ids):,} tokens: {text[: args.chars]!r}{more}")
    return 0
