from pglease import Owner, PostgresStore, metrics

server = metrics.serve(0)  # port 0: a free one; serve(9464) for a fixed port
print(server.url)  # http://127.0.0.1:PORT/metrics
with PostgresStore() as store, store.hold("run", "nightly", Owner("host", "h1"), ttl=10):
    pass  # claims, heartbeats, releases... are counted while serve()'s endpoint runs
server.stop()
