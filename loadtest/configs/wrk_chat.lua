-- wrk: POST a small non-streaming chat completion for "demo-model".
-- Usage: wrk -t1 -c32 -d10s -s loadtest/configs/wrk_chat.lua http://127.0.0.1:8080/v1/chat/completions
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"demo-model","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":16}'
