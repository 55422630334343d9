"""How the tests' processes and the processes they start compile, for XLA_FLAGS (see conftest.py)."""

# The tests' programs are tiny: compiling them is most of their time and running them next to none,
# so XLA's backend compiles them unoptimised (about 1.7x faster to compile), with the older
# elemental emitters instead of the MLIR fusion emitters (a further 1.7x; the programs run about
# 10% slower and compute the same).
TEST_COMPILES = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
