"""The mesh: one model split by layer ranges across stations (`station`, each a `stage`), driven by a host that
speaks the station's and the OpenAI API (`host`), over the binary payload format of `group.payload`."""
