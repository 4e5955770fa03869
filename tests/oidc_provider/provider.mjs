// A real OpenID provider for gpuorch's sign-in tests and the dev demo: panva's oidc-provider (OpenID certified),
// not a mock. Listens on 127.0.0.1 (OIDC_PORT, default 0: a free port) and prints one JSON line
// {"issuer": "http://127.0.0.1:<port>"} once it serves.
//
//   client OIDC_CLIENT_ID (default "gpuorch"): public (no secret), native, authorization code + PKCE (S256 required),
//     device code (RFC 8628), refresh tokens; any loopback redirect URI (RFC 8252: the port is not compared)
//   accounts: ACCOUNTS below; the login form (devInteractions) takes any password; consent is given at once
//   signing keys: the private JWKS in the file OIDC_JWKS (the tests hold the same keys to forge bad tokens)
//   ID token lifetime: OIDC_ID_TOKEN_TTL seconds (default 600)
import fs from 'node:fs';
import http from 'node:http';

import Provider from 'oidc-provider';

const ACCOUNTS = {
  alice: { email: 'alice@example.test', groups: ['acme-devs'] },
  olga: { email: 'olga@example.test', groups: ['staff', 'gpuorch-operators'] },
  mallory: { email: 'mallory@example.test', groups: ['contractors'] },
};

const isLoopback = (origin) => {
  try {
    const url = new URL(origin);
    return url.protocol === 'http:' && ['127.0.0.1', 'localhost', '[::1]'].includes(url.hostname);
  } catch {
    return false;
  }
};

const jwks = process.env.OIDC_JWKS ? JSON.parse(fs.readFileSync(process.env.OIDC_JWKS, 'utf8')) : undefined;
const clientId = process.env.OIDC_CLIENT_ID || 'gpuorch';
const server = http.createServer();

server.listen(Number(process.env.OIDC_PORT || 0), '127.0.0.1', () => {
  const issuer = `http://127.0.0.1:${server.address().port}`;
  const provider = new Provider(issuer, {
    clients: [{
      client_id: clientId,
      application_type: 'native',
      token_endpoint_auth_method: 'none',
      grant_types: ['authorization_code', 'refresh_token', 'urn:ietf:params:oauth:grant-type:device_code'],
      response_types: ['code'],
      redirect_uris: ['http://127.0.0.1/', 'http://localhost/'],
      post_logout_redirect_uris: ['http://127.0.0.1/', 'http://localhost/'],
    }],
    ...(jwks ? { jwks } : {}),
    cookies: { keys: ['gpuorch-test-provider'] },
    scopes: ['openid', 'offline_access', 'profile', 'email', 'groups'],
    claims: { openid: ['sub'], profile: ['preferred_username'], email: ['email'], groups: ['groups'] },
    conformIdTokenClaims: false, // the scopes' claims go into the ID token, as Keycloak and Okta can be set to
    findAccount: async (_ctx, id) => ({
      accountId: id,
      claims: async () => ({
        sub: id, preferred_username: id, email: ACCOUNTS[id]?.email ?? `${id}@example.test`,
        groups: ACCOUNTS[id]?.groups ?? [],
      }),
    }),
    features: {
      devInteractions: { enabled: true },
      deviceFlow: { enabled: true },
      rpInitiatedLogout: { enabled: true },
      revocation: { enabled: true },
    },
    pkce: { required: () => true },
    clientBasedCORS: (_ctx, origin) => isLoopback(origin),
    issueRefreshToken: async (_ctx, client) => client.grantTypeAllowed('refresh_token'),
    // consent at once: a grant of everything the client asked for (the first-party recipe of oidc-provider)
    loadExistingGrant: async (ctx) => {
      const grantId = ctx.oidc.result?.consent?.grantId || ctx.oidc.session.grantIdFor(ctx.oidc.client.clientId);
      if (grantId) return ctx.oidc.provider.Grant.find(grantId);
      const grant = new ctx.oidc.provider.Grant({ clientId: ctx.oidc.client.clientId, accountId: ctx.oidc.session.accountId });
      grant.addOIDCScope(ctx.oidc.requestParamScopes ? [...ctx.oidc.requestParamScopes].join(' ') : 'openid');
      grant.addOIDCClaims(['sub', 'preferred_username', 'email', 'groups']);
      await grant.save();
      return grant;
    },
    ttl: {
      IdToken: Number(process.env.OIDC_ID_TOKEN_TTL || 600),
      AccessToken: 600,
      DeviceCode: 600,
      RefreshToken: 86400,
      Session: 86400,
      Grant: 86400,
      Interaction: 600,
    },
  });
  provider.proxy = false;
  provider.on('end_session.error', (_ctx, error) => console.error('end_session.error', error, error.cause));
  server.on('request', provider.callback());
  process.stdout.write(`${JSON.stringify({ issuer })}\n`);
});

for (const signal of ['SIGTERM', 'SIGINT']) process.on(signal, () => process.exit(0));
