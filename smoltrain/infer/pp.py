"""Pipeline-parallel decode: each rank holds a run of layers and passes the hidden state on.

Rank 0 embeds; every stage sends its output to the next; the last stage samples and
sends the token id (one int64) back to rank 0, which feeds it into the next step.
Stages run one after another (batch 1), so per token each hop carries one hidden
state: `hidden * dtype bytes` (at `--wire-dtype`, infer.activations), plus 8 bytes back,
as the plan counts.
"""

from __future__ import annotations

import torch

from smoltrain.infer.engine import Engine, Stop, is_marker


class PipelineEngine(Engine):
    def _run(self, x, sampler) -> int | None:
        """x: ids (rank 0) or None (receive the hidden state); returns the token on rank 0."""
        st, r, N, comm = self.stage, self.rank, self.world, self.comm
        tokbuf = torch.zeros(1, dtype=torch.int64)
        if r > 0:
            buf = self.codec.buffer(x)
            comm.recv(buf, r - 1)
            x = self.codec.decode(buf)
            if is_marker(x):
                if not st.is_last:
                    comm.send(buf, r + 1)
                raise Stop
        out = st(x)
        if st.is_last:
            tokbuf[0] = sampler(out)
            comm.send(tokbuf, 0)
        else:
            comm.send(self.codec.encode(out), r + 1)
        if r == 0:
            comm.recv(tokbuf, N - 1)
            return int(tokbuf[0])
        return None

    def prefill(self, ids, sampler):
        return self._run(ids if self.rank == 0 else ids.shape[1], sampler)

    def step(self, tok, sampler):
        return self._run(torch.tensor([[tok]]) if self.rank == 0 else 1, sampler)

    def signal_stop(self) -> None:
        self.comm.send(self.codec.encode(self.marker()), 1)
