// gpuorch dashboard: sign-in with the team's OpenID provider, next to the API token form of app.js.
// Loaded before app.js. GET /api/v1/auth/config says whether single sign-on is on ({"oidc": null}: tokens only).
//   "Sign in with <provider>": authorization code + PKCE (RFC 7636, S256; a public client, no secret): the
//     verifier, state and nonce wait in sessionStorage while the browser is at the provider; back at "/?code=",
//     the code is exchanged at the provider's token endpoint, state and nonce are checked, and the ID token is
//     handed to app.js's sign-in (window.gpuorchSignIn) as the bearer token. The API verifies it (oidc.py).
//   "Sign out": forgets the token; after a single sign-on, also ends the provider's session where it offers
//     end_session_endpoint (RP-initiated logout), coming back to "/".
"use strict";

(() => {
  const PENDING = "gpuorch-oidc-pending";     // sessionStorage: {verifier, state, nonce, hash} during a sign-in
  const SSO = "gpuorch-oidc-signed-in";       // localStorage: the token in "gpuorch-token" came from the provider
  const TOKEN = "gpuorch-token";              // app.js's
  const query = new URLSearchParams(location.search);
  const returning = query.has("code") || query.has("error");
  if (returning) localStorage.removeItem(TOKEN);  // app.js must not sign in with an older token meanwhile

  const b64url = (bytes) => btoa(String.fromCharCode(...new Uint8Array(bytes)))
    .replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  const random = (n = 32) => b64url(crypto.getRandomValues(new Uint8Array(n)));
  const redirectUri = () => `${location.origin}/`;

  function showError(message) {
    const p = document.createElement("p");
    p.className = "error";
    p.id = "login-error";
    p.textContent = message;
    document.getElementById("view").replaceChildren(p);
  }

  async function start(oidc) {
    const verifier = random(48), state = random(), nonce = random();
    const challenge = b64url(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(verifier)));
    sessionStorage.setItem(PENDING, JSON.stringify({ verifier, state, nonce, hash: location.hash }));
    const params = new URLSearchParams({
      response_type: "code", client_id: oidc.client_id, redirect_uri: redirectUri(), state, nonce,
      scope: oidc.scopes.filter((s) => s !== "offline_access").join(" "),  // the page keeps no refresh token
      code_challenge: challenge, code_challenge_method: "S256",
    });
    location.assign(`${oidc.authorization_endpoint}?${params}`);
  }

  async function finish(oidc) {
    const pending = JSON.parse(sessionStorage.getItem(PENDING) || "null");
    sessionStorage.removeItem(PENDING);
    history.replaceState(null, "", `${location.pathname}${(pending && pending.hash) || "#/fleet"}`);
    if (query.has("error")) throw new Error(`sign-in refused: ${query.get("error_description") || query.get("error")}`);
    if (!pending || query.get("state") !== pending.state) throw new Error("sign-in answer does not match a sign-in started here");
    const response = await fetch(oidc.token_endpoint, {
      method: "POST", headers: { "Content-Type": "application/x-www-form-urlencoded" },
      body: new URLSearchParams({ grant_type: "authorization_code", code: query.get("code"),
        redirect_uri: redirectUri(), client_id: oidc.client_id, code_verifier: pending.verifier }),
    });
    const tokens = await response.json().catch(() => ({}));
    if (!response.ok || !tokens.id_token) {
      throw new Error(`sign-in failed at the provider: ${tokens.error_description || tokens.error || response.status}`);
    }
    const claims = JSON.parse(atob(tokens.id_token.split(".")[1].replace(/-/g, "+").replace(/_/g, "/")));
    if (claims.nonce !== pending.nonce) throw new Error("the ID token was not issued for this sign-in (nonce)");
    localStorage.setItem(SSO, "1");
    return tokens.id_token;
  }

  function signOut(oidc) {
    const token = localStorage.getItem(TOKEN);
    const wasSso = localStorage.getItem(SSO) === "1";
    localStorage.removeItem(TOKEN);
    localStorage.removeItem(SSO);
    sessionStorage.removeItem(PENDING);
    if (wasSso && token && oidc && oidc.end_session_endpoint) {
      const params = new URLSearchParams({ id_token_hint: token, client_id: oidc.client_id,
        post_logout_redirect_uri: redirectUri() });
      location.assign(`${oidc.end_session_endpoint}?${params}`);
    } else {
      location.assign(redirectUri());  // a fresh page: nothing of the session is left in memory
    }
  }

  function button(id, text, onclick) {
    const b = document.createElement("button");
    b.type = "button";
    b.id = id;
    b.textContent = text;
    b.addEventListener("click", onclick);
    return b;
  }

  async function setUp() {
    let oidc = null;
    try {
      const response = await fetch("/api/v1/auth/config");
      if (response.ok) oidc = (await response.json()).oidc;
    } catch (_) { /* the API is not up: token sign-in only */ }
    const form = document.getElementById("login");
    const who = document.getElementById("who");
    const out = button("sign-out", "Sign out", () => signOut(oidc));
    out.hidden = !who.textContent;
    form.insertBefore(out, who);
    new MutationObserver(() => { out.hidden = !who.textContent; }).observe(who, { childList: true, characterData: true, subtree: true });
    if (!oidc) return;
    form.insertBefore(button("sso", `Sign in with ${oidc.provider_name}`, () => start(oidc).catch((e) => showError(e.message))), out);
    if (returning) {
      try {
        const token = await finish(oidc);
        window.gpuorchSignIn(token);
      } catch (e) { showError(e.message); }
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", setUp);
  else setUp();
})();
