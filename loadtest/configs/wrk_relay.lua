-- wrk: POST a small non-streaming chat completion for model "m" (loadtest/bench_relay.py).
-- Usage: wrk -t1 -c64 -d6s -s loadtest/configs/wrk_relay.lua http://127.0.0.1:8080/v1/chat/completions
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","messages":[{"role":"user","content":"hello there, how are you today?"}],"max_tokens":64}'
