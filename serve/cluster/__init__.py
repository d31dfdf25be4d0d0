"""kiln on Ray Serve: engine replicas behind one OpenAI ingress, prefix-aware routing, and prefill/decode
disaggregation with KV pages moved through Ray's object store (docs/DISTRIBUTED.md).

  app.py        the Ray Serve application: deployments, their options, `kiln serve --replicas`
  replica.py    one kiln engine in a replica (a generate, a prefill that exports its KV)
  remote.py     the ingress's side: the routes' engine, backed by replicas (retries, lost replicas)
  router.py     prefix-aware and round-robin request routers (Ray Serve's RequestRouter)
  transport.py  how a KV snapshot travels from a prefill replica to a decode replica
  board.py      the replicas' gauges, gathered for the ingress's /metrics
"""
