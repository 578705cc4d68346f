// Drive a server with the official openai-node SDK, as a JavaScript user would; print one JSON report.
//
//   node tests/node_client.mjs videos|images BASE_URL API_KEY
//
// The SDK is imported from OPENAI_NODE_DIR (scripts/setup.sh installs it into .venv/openai-node).
// Extension fields go in the params object beside OpenAI's own: the SDK sends every key it is given
// (TypeScript code marks them with `// @ts-expect-error`).
import { pathToFileURL } from "node:url";
import { join } from "node:path";

const sdkDir = join(process.env.OPENAI_NODE_DIR, "node_modules", "openai");
const { default: OpenAI } = await import(pathToFileURL(join(sdkDir, "index.mjs")).href);
const { VERSION: version } = await import(pathToFileURL(join(sdkDir, "version.mjs")).href);

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function waitDone(c, id) {
  for (let i = 0; i < 3000; i++) {
    const v = await c.videos.retrieve(id);
    if (v.status === "completed" || v.status === "failed") return v;
    await sleep(100);
  }
  throw new Error(`${id} not done`);
}

async function errorOf(promise) {
  try {
    await promise;
    return "accepted";
  } catch (e) {
    return { status: e.status, name: e.constructor.name, error: e.error ?? null };
  }
}

async function videos(c) {
  const extra = { num_inference_steps: 2, negative_prompt: "blurry", seed: 11 };
  const created = await c.videos.create({ prompt: "a kite over the sea", seconds: "1", size: "48x32", ...extra });
  const done = await waitDone(c, created.id);
  const listed = await c.videos.list({ limit: 100 });
  const video = Buffer.from(await (await c.videos.downloadContent(created.id)).arrayBuffer());
  const thumb = Buffer.from(await (await c.videos.downloadContent(created.id, { variant: "thumbnail" })).arrayBuffer());
  const sheet = Buffer.from(await (await c.videos.downloadContent(created.id, { variant: "spritesheet" })).arrayBuffer());
  let remix = await c.videos.remix(created.id, { prompt: "a kite over the sea" });
  remix = await waitDone(c, remix.id);
  const remixBytes = Buffer.from(await (await c.videos.downloadContent(remix.id)).arrayBuffer());
  const deleted = await c.videos.delete(remix.id);
  return {
    created_status: created.status, done, listed_ids: listed.data.map((v) => v.id),
    video_head: video.subarray(4, 8).toString("latin1"), video_len: video.length,
    thumb_head: thumb.subarray(0, 4).toString("latin1") + thumb.subarray(8, 12).toString("latin1"),
    sheet_head: sheet.subarray(0, 3).toString("hex"),
    remix, remix_same_bytes: remixBytes.equals(video), deleted,
    after_delete: await errorOf(c.videos.retrieve(remix.id)),
    bad_request: await errorOf(c.videos.create({ prompt: "x", size: "30x30", seconds: "1" })),
  };
}

async function images(c) {
  const extra = { num_inference_steps: 2, seed: 3, negative_prompt: "blurry", true_cfg_scale: 4.0 };
  const b64 = await c.images.generate({ prompt: "a red bicycle", size: "32x32", n: 2, response_format: "b64_json", ...extra });
  // The same request as a url answer: n 2 again, since a batch of 2's first image need not be a lone
  // image's bytes (a bfloat16 matmul's kernel on an AVX2-only CPU depends on the batch).
  const url = await c.images.generate({ prompt: "a red bicycle", size: "32x32", n: 2, response_format: "url", ...extra });
  const fetched = Buffer.from(await (await fetch(url.data[0].url, { headers: { Authorization: `Bearer ${c.apiKey}` } })).arrayBuffer());
  return {
    b64_count: b64.data.length, b64_first: b64.data[0].b64_json, size: b64.size,
    url: url.data[0].url, url_bytes_b64: fetched.toString("base64"),
    bad_request: await errorOf(c.images.generate({ prompt: "x", size: "32x32", quality: "ultra" })),
  };
}

const [mode, base, key] = process.argv.slice(2);
const c = new OpenAI({ baseURL: `${base}/v1`, apiKey: key, maxRetries: 0, timeout: 300_000 });
const report = mode === "videos" ? await videos(c) : await images(c);
console.log("REPORT " + JSON.stringify({ sdk: version, node: process.version, ...report }));
