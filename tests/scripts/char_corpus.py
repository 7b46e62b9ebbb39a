"""The users'-style GPT test scripts' data: a small character corpus, its vocabulary, and
fixed-length chunks of it (one dataset item = ``BLOCK`` characters and the next ones)."""

import torch

TEXT = ("the quick brown fox jumps over the lazy dog. " * 400
        + "pack my box with five dozen liquor jugs. " * 300)
chars = sorted(set(TEXT))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in TEXT])
n = int(0.9 * len(data))  # train / validation split
BLOCK = 32


class Chunks(torch.utils.data.Dataset):
    """Item i: (characters i*BLOCK.., the same shifted by one); ``limit`` items at most."""

    def __init__(self, d, limit=None):
        self.d, self.n = d, (len(d) - 1) // BLOCK if limit is None else limit

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        s = self.d[i * BLOCK:(i + 1) * BLOCK + 1]
        return s[:-1], s[1:]
