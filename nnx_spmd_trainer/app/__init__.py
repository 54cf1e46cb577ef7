"""The example application on top of the library: a user of ``nnx_spmd_trainer`` like any other.

``cli`` (the ``nnx-spmd-train`` command), ``tasks`` (what a config builds),
``models`` (GPT, MLP, CNN) and ``datasets`` (pydoc text, synthetic data). The
core never imports this package; import its modules by name.
"""
