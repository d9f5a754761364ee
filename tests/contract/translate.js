// A Translate client built from translate.proto alone (grpc-js + proto-loader), as an integrator in another
// language would write it: no kvferry code. tests/test_contract.py runs it against a real sidecar and compares
// its answer with the Python client's, byte for byte.
//
//   node translate.js <address> <translate.proto> <input.json> <output.json>
//
// input.json: {header: TranslateHeader fields, chunk_tokens, tokens, kv_heads, head_dim,
//              layers: [{k: base64 fp32 [kv_heads, tokens, head_dim], v: ...}, ...]}
// output.json: {header, trailer, layers: [{k: base64, v: base64}]} (each target layer's blocks joined along
//              tokens in block_index order, [kv_heads, tokens, head_dim]; paged answers are unpaged into that
//              form), or {code, details} when the call fails.
'use strict';
const fs = require('fs');
const grpc = require('@grpc/grpc-js');
const loader = require('@grpc/proto-loader');

const [address, protoPath, inPath, outPath] = process.argv.slice(2);
const definition = loader.loadSync(protoPath, {keepCase: true, longs: String, enums: String, defaults: true, oneofs: true});
const v1 = grpc.loadPackageDefinition(definition).kvferry.v1;
const input = JSON.parse(fs.readFileSync(inPath, 'utf8'));
const client = new v1.TranslateService(address, grpc.credentials.createInsecure(),
  {'grpc.max_receive_message_length': 64 << 20, 'grpc.max_send_message_length': 64 << 20});
const ELEMENT = {DTYPE_FLOAT32: 4, DTYPE_FLOAT16: 2, DTYPE_BFLOAT16: 2};

const call = client.Translate();
let header = null, trailer = null;
const blocks = [];
call.on('data', (m) => {
  if (m.msg === 'header') header = m.header;
  else if (m.msg === 'block') blocks.push(m.block);
  else if (m.msg === 'trailer') trailer = m.trailer;
});
call.on('error', (e) => {
  fs.writeFileSync(outPath, JSON.stringify({code: e.code, details: e.details}));
  client.close();
});
call.on('end', () => {
  const size = ELEMENT[header.dtype];
  const byLayer = new Map();
  for (const b of blocks) {
    if (!byLayer.has(b.layer)) byLayer.set(b.layer, []);
    byLayer.get(b.layer).push(b);
  }
  const layers = [];
  for (let t = 0; t < header.target.layers; t++) {
    const mine = (byLayer.get(t) || []).sort((a, b) => a.block_index - b.block_index);
    if (header.layout === 'LAYOUT_PAGED') {
      layers.push(unpaged(mine, size));
      continue;
    }
    const joined = {};
    for (const kind of ['key', 'value']) {
      const heads = [];
      for (let h = 0; h < header.target.kv_heads; h++) {
        for (const b of mine) {  // contiguous: [kv_heads, n, head_dim] row-major; head h's rows for each block
          const n = b.token_end - b.token_start, row = n * header.target.head_dim * size;
          heads.push(b[kind].data.subarray(h * row, (h + 1) * row));
        }
      }
      joined[kind === 'key' ? 'k' : 'v'] = Buffer.concat(heads).toString('base64');
    }
    layers.push(joined);
  }
  fs.writeFileSync(outPath, JSON.stringify({header, trailer, layers}));
  client.close();
});

// A paged layer's blocks as [kv_heads, tokens, head_dim]: each block holds whole pages of block_size tokens,
// token-major ([block_size, kv_heads, head_dim] a page), one a block when the response header's pages_per_block is
// 0, else [pages, block_size, kv_heads, head_dim] with pages <= pages_per_block; block_index is the first page's.
function unpaged(blocks, size) {
  const {block_size: bs, pages_per_block: most, num_tokens: n} = header;
  const {kv_heads: H, head_dim: D} = header.target;
  const row = D * size;
  let page = 0;
  for (const b of blocks) {
    const pages = most === 0 ? 1 : b.key.shape[0];
    const want = most === 0 ? [bs, H, D] : [pages, bs, H, D];
    if (JSON.stringify(b.key.shape) !== JSON.stringify(want) || pages > Math.max(most, 1) || b.block_index !== page ||
        b.token_start !== page * bs) {
      throw new Error(`block ${JSON.stringify([b.block_index, b.token_start, b.key.shape])} is not page ${page} of ${JSON.stringify(want)}`);
    }
    page += pages;
  }
  const out = {};
  for (const kind of ['key', 'value']) {
    const tokenMajor = Buffer.concat(blocks.map((b) => b[kind].data));  // [pages * block_size, H, D]
    const heads = [];
    for (let h = 0; h < H; h++) {
      for (let i = 0; i < n; i++) heads.push(tokenMajor.subarray((i * H + h) * row, (i * H + h + 1) * row));
    }
    out[kind === 'key' ? 'k' : 'v'] = Buffer.concat(heads).toString('base64');
  }
  return out;
}

call.write({header: input.header});
const {tokens, kv_heads: H, head_dim: D, chunk_tokens: step} = input;
const source = input.layers.map((l) => ({k: Buffer.from(l.k, 'base64'), v: Buffer.from(l.v, 'base64')}));
for (let s = 0; s < tokens; s += step) {  // token order: each range for every layer, then the next range
  const e = Math.min(s + step, tokens);
  source.forEach((l, layer) => {
    for (const [kind, full] of [['KV_KIND_KEY', l.k], ['KV_KIND_VALUE', l.v]]) {
      const parts = [];
      for (let h = 0; h < H; h++) parts.push(full.subarray((h * tokens + s) * D * 4, (h * tokens + e) * D * 4));
      call.write({chunk: {layer, kind, token_start: s, token_end: e,
                          tensor: {dtype: 'DTYPE_FLOAT32', shape: [H, e - s, D], data: Buffer.concat(parts)}}});
    }
  });
}
call.end();
