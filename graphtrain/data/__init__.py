"""graphtrain data: corpus, tokenizer, sources, token caches and packed-sequence loaders.

The trainer uses one entry point, ``build_data`` (see build.py), which returns a ``DataBundle``.
"""

from graphtrain.data.build import DataBundle, build_data, check_inputs
from graphtrain.data.corpus import default_corpus_files
from graphtrain.data.loader import PackedLoader, RowLoader
from graphtrain.data.packing import pack_rows
from graphtrain.data.sources import iter_documents, load_token_shards
from graphtrain.data.tokenizer import Tokenizer, default_tokenizer, load_tokenizer

__all__ = [
    "DataBundle",
    "PackedLoader",
    "RowLoader",
    "Tokenizer",
    "build_data",
    "check_inputs",
    "default_corpus_files",
    "default_tokenizer",
    "iter_documents",
    "load_token_shards",
    "load_tokenizer",
    "pack_rows",
]
