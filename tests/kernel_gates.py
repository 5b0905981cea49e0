"""Our gated CUDA kernels (engine/kernels/device_check.py) on the CPU, where they cannot run: the
module's switch on, its kernels replaced by stand-ins, its switch and checks forgotten before and
after (a fixture's body: `yield from gate(monkeypatch, module, name=stand_in, ...)`)."""


def gate(monkeypatch, module, **kernels):
    monkeypatch.setattr(module, "mode", lambda: "on")
    for name, stand_in in kernels.items():
        monkeypatch.setattr(module, name, stand_in)
    module.reset()
    yield monkeypatch
    module.reset()
