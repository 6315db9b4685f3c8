"""Optimizers. Import from the modules: optim.muon (Muon), optim.muon.newton_schulz (the pure
momentum / Newton-Schulz / scale functions), optim.builder, ...

Deliberately empty otherwise: re-exporting `newton_schulz` here would shadow the
optim.muon.newton_schulz module attribute, and importing optim.muon would pull parallel.comm into
every `import optim.config`.
"""
