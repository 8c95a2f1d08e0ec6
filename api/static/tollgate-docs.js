// The docs page's script: starts Swagger UI on /schema/openapi.json and signs "Try it out"
// requests with SVC-AUTH in the browser (WebCrypto HMAC-SHA256), following api/auth.py.
// The secret never leaves the page: enter `KEY_ID:SECRET` in the SVC-AUTH field of
// "Authorize"; each request's Authorization header is then replaced by its signature.
"use strict";

(function (root) {
  const SIGNED = ["x-realm-id", "x-principal-id", "x-user-id", "x-billing-account-id",
                  "x-billing-user-id", "idempotency-key"];
  const encoder = new TextEncoder();

  function toBase64(buffer) {
    let text = "";
    for (const byte of new Uint8Array(buffer)) text += String.fromCharCode(byte);
    return btoa(text);
  }

  function fromBase64(text) {
    const raw = atob(text);
    const out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }

  async function contentDigest(body) {
    const hash = await crypto.subtle.digest("SHA-256", encoder.encode(body));
    return "sha-256=:" + toBase64(hash) + ":";
  }

  // The twelve signed lines, joined by "\n" (api/auth.py, _canonical).
  function canonical(method, path, ts, nonce, lower) {
    const lines = [method.toUpperCase(), path, "ts:" + ts, "nonce:" + nonce,
                   "content-digest:" + (lower["content-digest"] || ""),
                   "content-type:" + (lower["content-type"] || "")];
    for (const name of SIGNED) lines.push(name + ":" + (lower[name] || ""));
    return lines.join("\n");
  }

  function randomNonce() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // Headers of a signed request: `headers` plus Content-Digest and Authorization.
  // `ts` and `nonce` are for tests; by default the current time and 16 random bytes.
  async function signHeaders({ keyId, secret, method, path, body, headers, ts, nonce }) {
    const out = {};
    for (const [name, value] of Object.entries(headers || {})) {
      const lower = name.toLowerCase();
      if (lower !== "authorization" && lower !== "content-digest") out[lower] = String(value);
    }
    out["content-digest"] = await contentDigest(body || "");
    ts = ts || new Date().toISOString();
    nonce = nonce || randomNonce();
    const key = await crypto.subtle.importKey("raw", fromBase64(secret), { name: "HMAC", hash: "SHA-256" },
                                              false, ["sign"]);
    const mac = await crypto.subtle.sign("HMAC", key, encoder.encode(canonical(method, path, ts, nonce, out)));
    out["authorization"] = "SVC-AUTH keyId=" + keyId + ",sig=" + toBase64(mac) + ",ts=" + ts +
                           ",nonce=" + nonce + ",alg=HMAC-SHA256";
    return out;
  }

  // Swagger UI's requestInterceptor: sign when Authorization holds `KEY_ID:SECRET`.
  async function signRequest(request) {
    const headers = request.headers || {};
    const authName = Object.keys(headers).find((n) => n.toLowerCase() === "authorization");
    const credentials = authName ? String(headers[authName]) : "";
    const colon = credentials.indexOf(":");
    if (!credentials || credentials.startsWith("SVC-AUTH ") || colon < 1) return request;
    if (!root.crypto || !root.crypto.subtle) {
      throw new Error("signing needs WebCrypto: open this page over https or on localhost/127.0.0.1");
    }
    const url = new URL(request.url, root.location ? root.location.href : undefined);
    let body = request.body;
    if (body === undefined || body === null) body = "";
    else if (typeof body !== "string") body = JSON.stringify(body);
    request.body = body;
    request.headers = await signHeaders({
      keyId: credentials.slice(0, colon), secret: credentials.slice(colon + 1),
      method: request.method || "GET", path: url.pathname + url.search, body, headers,
    });
    return request;
  }

  const api = { canonical, contentDigest, signHeaders, signRequest };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  root.tollgateDocs = api;

  if (typeof root.SwaggerUIBundle === "function" && root.document) {
    root.ui = root.SwaggerUIBundle({
      url: "/schema/openapi.json",
      dom_id: "#swagger-ui",
      deepLinking: true,
      validatorUrl: null,
      tryItOutEnabled: true,
      requestInterceptor: signRequest,
      presets: [root.SwaggerUIBundle.presets.apis],
      layout: "BaseLayout",
    });
  }
})(typeof window !== "undefined" ? window : globalThis);
