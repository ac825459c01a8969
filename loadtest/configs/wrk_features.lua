-- wrk: a small chat completion with an API key and one of 1,000 session ids; collects the gateway's
-- x-gridgate-overhead-ms header. Used by loadtest/bench_features.py for every variant (headers a
-- variant does not use are simply ignored by it; Authorization is never forwarded upstream).
-- done() prints:  OVERHEAD_MS n=<count> missing=<count> p50=<ms> p90=<ms> p99=<ms> max=<ms>
local body = '{"model":"demo-model","messages":[{"role":"user","content":"Say hello in five words."}],"max_tokens":16}'
local threads = {}
local counter = 0

function setup(thread)
  table.insert(threads, thread)
end

function init(args)
  overhead = {}
  missing = 0
end

function request()
  counter = counter + 1
  local headers = {
    ["Content-Type"] = "application/json",
    ["Authorization"] = "Bearer sk-bench",
    ["X-Session-Id"] = "session-" .. (counter % 1000),
  }
  return wrk.format("POST", nil, headers, body)
end

function response(status, headers, body)
  local value = nil
  for name, v in pairs(headers) do
    if string.lower(name) == "x-gridgate-overhead-ms" then
      value = tonumber(v)
    end
  end
  if value then
    overhead[#overhead + 1] = value
  else
    missing = missing + 1
  end
end

local function percentile(sorted, p)
  if #sorted == 0 then return 0 end
  local index = math.max(1, math.ceil(p / 100 * #sorted))
  return sorted[index]
end

function done(summary, latency, requests)
  local all, lost = {}, 0
  for _, thread in ipairs(threads) do
    for _, v in ipairs(thread:get("overhead")) do all[#all + 1] = v end
    lost = lost + thread:get("missing")
  end
  table.sort(all)
  io.write(string.format("OVERHEAD_MS n=%d missing=%d p50=%.4f p90=%.4f p99=%.4f max=%.4f\n",
    #all, lost, percentile(all, 50), percentile(all, 90), percentile(all, 99), percentile(all, 100)))
end
