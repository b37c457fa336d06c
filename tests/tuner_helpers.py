"""Shared by the packed-trial tests: a reference that trains ONE configuration by a plain loop
on given positions of the shared input stream."""
from __future__ import annotations

from jabasray.tuner.training import SharedStream, build_member, cached_data

STREAM = 40          # the shared stream's chunk (largest batch size) of the tests


class Alone:
    """Reference: one configuration trained by a plain loop on given stream positions."""

    def __init__(self, config, spec):
        self.spec, self.config = spec, config
        self.model, self.opt = build_member(spec, config)
        self.stream = SharedStream(cached_data(spec)[0], STREAM, spec.seed)
        self.b = spec.batch_size_of(config)

    def unit(self, position):
        losses = []
        for j in range(position, position + self.spec.steps_per_unit):
            x, y = self.stream.batch(j, self.b)
            self.opt.zero_grad()
            loss = self.spec.loss_fn(self.model(x), y)
            loss.backward()
            self.opt.step()
            losses.append(loss.item())
        return sum(losses) / len(losses), float(self.spec.metric_fn(self.model, cached_data(self.spec)[1]))


