// What both pages share: calls to this server with the API key the user gave (kept in this
// browser's localStorage only), and the form that asks for it when the server answers 401.
"use strict";

const KEY_ITEM = "pyserve-api-key";

function apiKey() {
  return localStorage.getItem(KEY_ITEM) || "";
}

function authHeaders(extra) {
  const headers = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) headers["Authorization"] = "Bearer " + key;
  return headers;
}

// Shows the key form; resolves once a key is saved.
function askForKey(message) {
  const form = document.getElementById("key-form");
  const input = document.getElementById("key-input");
  document.getElementById("key-message").textContent = message;
  form.hidden = false;
  input.focus();
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      localStorage.setItem(KEY_ITEM, input.value.trim());
      input.value = "";
      form.hidden = true;
      resolve();
    };
  });
}

// fetch() against this server with the key; on 401 asks for a key and tries again.
async function api(path, options) {
  for (;;) {
    const opts = Object.assign({}, options || {});
    opts.headers = authHeaders(opts.headers);
    const response = await fetch(path, opts);
    if (response.status !== 401) return response;
    await askForKey(apiKey() ? "That key was refused: enter the server's API key." :
      "This server needs an API key (kept in this browser only).");
  }
}

function clearKey() {
  localStorage.removeItem(KEY_ITEM);
}

// The message of an OpenAI-shaped error body, or the status line.
async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return response.status + " " + response.statusText;
}
