"""titan-data: text files -> a flat token file plus its sidecar, for titan-run --data."""

from __future__ import annotations

from pathlib import Path

import click

from titan.cli.errors import Command
from titan.cli.options import NonEmptyPath


@click.command(cls=Command)
@click.argument("texts", nargs=-1, required=True, type=NonEmptyPath(dir_okay=False, path_type=Path))
@click.option("-o", "--out", required=True, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="Token file to write (its sidecar goes to OUT.json).")
@click.option("--tokenizer", "tokenizer_path", required=True, type=NonEmptyPath(dir_okay=False, path_type=Path),
              help="A Hugging Face tokenizer.json or a tiktoken BPE ranks file (e.g. Llama-3's tokenizer.model).")
@click.option("--tiktoken-spec", default=None,
              help="Pattern and special tokens for a tiktoken ranks file (default llama3: Llama-3's); "
                   "not for a tokenizer.json.")
@click.option("--eos", default=None,
              help="Separator token appended after each document (default: the tokenizer's end-of-text token "
                   "if it has one; 'none' for no separator).")
@click.option("--documents", default="file", show_default=True, type=click.Choice(["file", "line"]),
              help="What one document is: a whole text file, or each non-empty line.")
def main(texts, out, tokenizer_path, tiktoken_spec, eos, documents):
    """Tokenize TEXTS (UTF-8 files, in order) into OUT for titan-run --data OUT."""
    from titan.cli.tools.token_file import load_tokenizer, write_token_file

    tok = load_tokenizer(tokenizer_path, eos=eos, tiktoken_spec=tiktoken_spec)
    summary = write_token_file(list(texts), out, tok, per_line=documents == "line")
    sep = "no separator" if tok.eos_id is None else f"separator id {tok.eos_id}"
    click.echo(f"wrote {out}: {summary.tokens:,} tokens ({summary.dtype}) from {summary.documents} document(s), "
               f"vocabulary {tok.vocab_size:,}, {sep}; sidecar {out}.json")


if __name__ == "__main__":
    main()
