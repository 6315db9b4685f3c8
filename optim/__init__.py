"""Optimizers. Import from the modules: optim.muon (Muon), optim.newton_schulz (the pure
momentum / Newton-Schulz / scale functions), optim.builder, ...

Deliberately empty otherwise: re-exporting `newton_schulz` here would shadow the
optim.newton_schulz module attribute, and importing optim.muon would pull parallel.comm into
every `import optim.config`.
"""
