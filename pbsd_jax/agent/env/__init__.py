"""The search environment: protocol, action parsing, observations, retrievers.

Modules (import the one you need; this package imports nothing, so the protocol stays cheap):
  protocol        tags and prompt templates
  actions         `parse_action`: one turn's text -> search / answer / invalid
  observations    `escape_document`, `format_observation`, notices
  agent_env       `AgentEnv`, `classify_turn`, `assemble_observation`: the rules on token ids
  retriever       the `Retriever` interface, `Document`, `RetrievalError`
  bm25            `BM25Index`: device-resident, jittable BM25 (the in-graph retriever)
  token_retriever `TokenBM25Retriever`: the same index behind the text interface
  host_bm25       `HostBM25Retriever`: bm25s over large text corpora
  http            `RetrievalServer` / `HttpRetriever`: the Search-R1 retrieval protocol
"""
