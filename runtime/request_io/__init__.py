"""Between a user and the scheduler, shared by the in-process Engine and the HTTP server: user input prepared into a
`Req` (prepare), scheduler outputs folded into results (output_accumulator) with incremental detokenization and
stop strings (detokenizer)."""
