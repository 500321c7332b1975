"""The GPU suite's sharding option."""


def pytest_addoption(parser):
    # A cold machine compiles every specialisation the suite touches (~9 minutes in one
    # process, against a 10-minute limit per device call); benchmarks/run_gpu.sh runs the
    # suite as parallel shards that share Triton's on-disk cache.
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run only the tests whose collection index is I modulo N (0 <= I < N)")


def pytest_collection_modifyitems(config, items):
    shard = config.getoption("--shard")
    if not shard:
        return
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise ValueError(f"--shard {shard}: need 0 <= I < N")
    keep = [item for n, item in enumerate(items) if n % count == index]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
